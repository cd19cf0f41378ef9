r"""DecompX's frozen building blocks and their written-out transposes (docs/design.md, section 8, adjoint algorithm).

With every nonlinear quantity frozen at its real value (attention probabilities, norm
scales, FF coefficients) a layer is an affine map of its input. The pieces here are shared
by the layer kinds' frozen layers and their transposes (``LayerKind.frozen_layer`` and
``LayerKind.frozen_layer_vjp``, in the kinds' modules): the attention block
x -> x + Attn(N1(x)) (:func:`frozen_attention_block`, transpose :func:`attention_block_vjp`),
the FF branch z -> FF(N2(z)) (:func:`frozen_ff_branch`, :func:`ff_branch_vjp`), and the
transposes of a norm frozen at its scale (:func:`norm_transpose`) and of the attention
mixing (:func:`mix_transpose`, which skips most of a causal layer's all-zero triangle).

The transposes are written out instead of taken by autograd, so that no forward pass of
the frozen layer (and no graph) is needed; they are linear in the cotangent, so several
cotangents stacked along leading dimensions go through in one call. :mod:`.adjoint` walks the
layers with them.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.channel_mixing import is_channel_mixing
from captum_normattr.decompose.methods.decompx.parts import value_heads
from captum_normattr.decompose.primitives.layer_norm import apply_norm_to_parts, norm_bias_part, norm_scale
from captum_normattr.decompose.records import LayerTensors, NormParams

__all__ = [
    "CAUSAL_BLOCKS",
    "attention_block_vjp",
    "ff_branch_vjp",
    "frozen_attention_block",
    "frozen_ff_branch",
    "mix_transpose",
    "norm_transpose",
    "scatter_rows",
]

def frozen_attention_block(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""x_i + Attn(N1(x))_i with the probabilities and N1's scale frozen at their real values: (B, R, D).

    Args: as in :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer` (``with_bias``: beta1, b_V and b_O).
    """
    b, t, _ = x.shape
    h = layer.num_heads
    hd = layer.out_weight.shape[0]
    kv_heads = value_weight.shape[1] // (hd // h)
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    u = norm_bias_part(x, layer.ln1_in, layer.ln1) if with_bias else apply_norm_to_parts(x, layer.ln1_in, layer.ln1)
    v = u @ value_weight
    if with_bias and value_bias is not None:
        v = v + value_bias
    if is_channel_mixing(layer.probs):  # a hybrid mixer: one head of size 1 per channel, its factored mixing applied
        mixed = sel(layer.probs.context(v))  # (B, R, N)
    else:
        probs = sel(layer.probs.transpose(1, 2)).transpose(1, 2)
        mixed = torch.einsum("bhij,bjhe->bihe", probs, value_heads(v, kv_heads, h // kv_heads))
    hcur = mixed.reshape(b, mixed.shape[1], hd) @ layer.out_weight + sel(x)
    if with_bias and layer.out_bias is not None:
        hcur = hcur + layer.out_bias
    return hcur


def frozen_ff_branch(
    u: Tensor, real_in: Tensor, layer: LayerTensors, with_bias: bool, coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""FF(N2(u)) with N2's scale and the FF coefficients frozen at their real values: (B, R, D).

    Args:
        u: (B, R, D) the norm input at ``rows``; real_in: (B, R, D) its real value there.
        layer: the layer's tensors; with_bias: add beta2, the FF biases and g(0) W2.
        coefs: :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` of the layer (all T rows); rows: (R,) long or None.
    """
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    z = norm_bias_part(u, real_in, layer.ln2) if with_bias else apply_norm_to_parts(u, real_in, layer.ln2)
    f = layer.ff

    def lin(w: Tensor, bb: Optional[Tensor]) -> Tensor:
        return z @ w + bb if (with_bias and bb is not None) else z @ w

    if f.w_gate is None:
        ig = lin(f.w_in, f.b_in) * sel(coefs["slope"])
        if with_bias:
            ig = ig + f.act(torch.zeros((), dtype=u.dtype, device=u.device))
    else:
        ig = lin(f.w_gate, f.b_gate) * sel(coefs["gate"]) + lin(f.w_in, f.b_in) * sel(coefs["up"])
    ff = ig @ f.w_out
    if with_bias and f.b_out is not None:
        ff = ff + f.b_out
    return ff


def norm_transpose(w: Tensor, real: Tensor, params: NormParams) -> Tensor:
    r"""The transpose of a norm's frozen linear map x -> gamma c(x) / s(real) applied to ``w`` (..., D).

    The centering c (LayerNorm) is a symmetric projection, so the transpose is
    c(gamma w / s); RMSNorm: gamma w / s.
    """
    scale = norm_scale(real, params).unsqueeze(-1)
    out = w * params.weight.to(w.dtype) if params.weight is not None else w
    out = out / scale
    return out if params.kind != "layernorm" else out - out.mean(-1, keepdim=True)


#: Query blocks of the causal transpose in :func:`mix_transpose` (the blocks above the diagonal are skipped).
CAUSAL_BLOCKS = 8


def mix_transpose(g_mixed: Tensor, probs: Tensor, kv_heads: int, causal: bool = False) -> Tensor:
    r"""The transpose of the frozen attention mixing: (..., B, R, H, Dh) -> (..., B, T, H_kv * Dh).

    mixed_i^h = sum_j alpha^h_ij v_j^{h // groups}: the value cotangent of key j is
    sum_i alpha^h_ij g_i^h, summed over the query heads that share a key/value head.
    ``causal`` (all T rows, and alpha_ij = 0 for j > i wherever g_i is not 0): query block
    [i0, i1) reaches keys j < i1 only, so most of the all-zero triangle is skipped.
    Leading stack dimensions (several cotangents of the same layer) are folded into the
    free last dimension, (B, R, H, n Dh), so that one product with the probabilities serves all.
    """
    lead = g_mixed.shape[:-4]
    b, r, h, dh = g_mixed.shape[-4:]
    n = 1
    for k in lead:
        n *= k
    if lead:  # (n, B, R, H, Dh) -> (B, R, H, n Dh)
        g_mixed = g_mixed.reshape(n, b, r, h, dh).permute(1, 2, 3, 0, 4).reshape(b, r, h, n * dh)
    e = n * dh
    t = probs.shape[-1]
    if causal and r == t and t >= 2 * CAUSAL_BLOCKS:
        gh = g_mixed.permute(0, 2, 1, 3)  # (B, H, T, n Dh)
        g_v = g_mixed.new_zeros(b, h, t, e)
        size = -(-t // CAUSAL_BLOCKS)
        for i0 in range(0, t, size):
            i1 = min(t, i0 + size)
            g_v[:, :, :i1] += probs[:, :, i0:i1, :i1].transpose(-1, -2) @ gh[:, :, i0:i1]
        g_v = g_v.permute(0, 2, 1, 3)  # (B, T, H, n Dh)
    else:
        g_v = torch.einsum("bhij,bihe->bjhe", probs, g_mixed)  # (B, T, H, n Dh)
    if kv_heads != h:
        g_v = g_v.reshape(b, t, kv_heads, h // kv_heads, e).sum(3)
    if not lead:
        return g_v.reshape(b, t, kv_heads * dh)
    g_v = g_v.reshape(b, t, kv_heads, n, dh).permute(3, 0, 1, 2, 4)  # (n, B, T, H_kv, Dh)
    return g_v.reshape(*lead, b, t, kv_heads * dh)


def scatter_rows(g_rows: Tensor, t: int, rows: Optional[Tensor]) -> Tensor:
    r"""(..., B, R, D) at ``rows`` into a zero (..., B, T, D) (itself when ``rows`` is None)."""
    if rows is None:
        return g_rows
    out = g_rows.new_zeros(*g_rows.shape[:-2], t, g_rows.shape[-1])
    out[..., rows, :] = g_rows
    return out


def _causal_rows(layer: LayerTensors, g_rows: Tensor, rows: Optional[Tensor], valid: Optional[Tensor]) -> bool:
    r"""Whether alpha_ij = 0 for j > i at every row i where ``g_rows`` (..., B, T, D) is not 0.

    True for a causal layer (all rows) when the cotangent vanishes at the pad rows: a fully
    masked pad query row attends uniformly to every key, later ones included.
    """
    if not layer.causal or rows is not None or valid is None:
        return False
    pads = ~valid.to(device=g_rows.device, dtype=torch.bool)
    if not bool(pads.any()):
        return True
    stacked = g_rows.reshape(-1, *g_rows.shape[-3:])  # (n, B, T, D)
    return not bool(stacked[:, pads].any())


def _gated_ff_transpose(g_ig: Tensor, coefs: Dict[str, Tensor], sel: Callable[[Tensor], Tensor], f: "object") -> Tensor:
    r"""The transpose of ig = (z W_gate) * gate + (z W_up) * up at ``g_ig`` (..., B, R, F): (..., B, R, D)."""
    width = g_ig.shape[-1]
    br = g_ig.shape[-3] * g_ig.shape[-2]
    flat = g_ig.reshape(-1, br, width)  # (n, B R, F)
    gate = sel(coefs["gate"]).reshape(br, width)
    up = sel(coefs["up"]).reshape(br, width)
    g_z = torch.mm((flat * gate).view(-1, width), f.w_gate.T)
    g_z.addmm_(flat.mul_(up).view(-1, width), f.w_in.T)
    return g_z.view(*g_ig.shape[:-1], f.w_gate.shape[0])


def ff_branch_vjp(
    g: Tensor, real_in: Tensor, layer: LayerTensors, coefs: Dict[str, Tensor], rows: Optional[Tensor] = None
) -> Tensor:
    r"""The transpose of the frozen z -> FF(N2(z)) (no biases; :func:`frozen_ff_branch`) at ``g``.

    Args:
        g: (..., B, R, D) cotangent of the FF output at ``rows`` (all T rows if None).
        real_in: (B, R, D) the second norm's real input at ``rows``.
        layer: the layer's tensors (``ln2``, ``ff``); coefs: its :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`.
        rows: (R,) long or None.

    Returns:
        (..., B, R, D) the cotangent of the norm input z at ``rows``.
    """
    sel = (lambda z: z) if rows is None else (lambda z: z[:, rows])
    f = layer.ff
    g_ig = g @ f.w_out.T  # (..., B, R, F)
    if f.w_gate is None:
        g_z = g_ig.mul_(sel(coefs["slope"])) @ f.w_in.T
    else:  # ig = (z W_gate) * gate + (z W_up) * up
        g_z = _gated_ff_transpose(g_ig, coefs, sel, f)
    del g_ig
    return norm_transpose(g_z, real_in, layer.ln2)


def attention_block_vjp(
    g_h: Tensor, layer: LayerTensors, value_weight: Tensor, rows: Optional[Tensor] = None, valid: Optional[Tensor] = None
) -> Tensor:
    r"""The transpose of the frozen x -> x + Attn(N1(x)) (no biases; :func:`frozen_attention_block`) at ``g_h``.

    Args:
        g_h: (..., B, R, D) cotangent of x + Attn(N1(x)) at ``rows`` (all T rows if None).
        layer, value_weight, rows, valid: as in :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer_vjp`.

    Returns:
        (..., B, T, D) the cotangent of the layer input x.
    """
    t = layer.hidden_in.shape[1]
    h = layer.num_heads
    hd = layer.out_weight.shape[0]
    kv_heads = value_weight.shape[1] // (hd // h)
    if is_channel_mixing(layer.probs):  # a hybrid mixer: the transpose of its factored mixing, O(T^2 N)
        g_mixed = g_h @ layer.out_weight.T  # (..., B, R, N)
        if rows is not None:  # the cotangent of every row, 0 outside ``rows``
            g_mixed = g_mixed.new_zeros(*g_mixed.shape[:-2], t, g_mixed.shape[-1]).index_copy_(
                -2, rows.to(g_mixed.device), g_mixed)
        g_u = layer.probs.transposed_context(g_mixed) @ value_weight.T
        return norm_transpose(g_u, layer.ln1_in, layer.ln1).add_(scatter_rows(g_h, t, rows))
    probs = layer.probs if rows is None else layer.probs[:, :, rows]
    g_mixed = (g_h @ layer.out_weight.T).view(*g_h.shape[:-1], h, hd // h)
    g_u = mix_transpose(g_mixed, probs, kv_heads, _causal_rows(layer, g_h, rows, valid)) @ value_weight.T
    return norm_transpose(g_u, layer.ln1_in, layer.ln1).add_(scatter_rows(g_h, t, rows))

