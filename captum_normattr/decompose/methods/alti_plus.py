r"""ALTI+ for encoder-decoders (Ferrando et al., EMNLP 2022): the pure mathematics.

Tensors in, tensors out; no model, no hooks (those are in :mod:`captum_normattr.models.seq2seq`).
The definition, with every choice, is in ``docs/seq2seq.md``. In short, for one attention
block with probabilities A^h_ij, values v^h_j (b_V inside), per-head output projections W_O^h
and output bias b_O, residual r_i and real block output y_i:

- parts p_ij = sum_h A^h_ij v^h_j W_O^h; self-attention: the residual joins the query's own
  part (p_ii += r_i); cross-attention: the residual is one extra part p_{i,K+1} = r_i;
- post-LN (BART, Marian): T_ij = gamma * (p_ij - mean(p_ij)) / sigma_i with sigma_i the scale
  of the real norm input (frozen), and the bias part gamma * (b_O - mean(b_O)) / sigma_i + beta;
  pre-LN (mBART, M2M100/NLLB, Pegasus, T5): T_ij = p_ij, the bias part b_O;
- c_ij = max(0, |y_i|_1 - |y_i - T_ij|_1) with y_i = sum_j T_ij + bias part, rows divided
  by their sums;
- encoder: the plain product of the layer maps; decoder layer l: M_l = [C^cross_l[:, :S] R^enc
  | rho_l * C^self_l] (rho_l: the residual column of C^cross_l), rolled out as the bottom row
  of prod_l [[I, 0], [M^src_l, M^tgt_l]].

The official code's quirks (the unbiased standard deviation for sigma, ``+1e-6`` inside the
L1 distance, the decoder rollout rows re-normalised) are options (:data:`OFFICIAL`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.methods.alti import alti_map
from captum_normattr.decompose.primitives.attention import project_values
from captum_normattr.decompose.primitives.layer_norm import NormLinearMap
from captum_normattr.decompose.records import NormParams

__all__ = [
    "ALTIPlusConventions",
    "DEFAULT",
    "LN_SCALES",
    "OFFICIAL",
    "alti_plus_rollout",
    "alti_plus_rollout_step",
    "block_contributions",
    "encoder_rollout",
    "norm_scale",
]

#: how the frozen scale sigma_i of a post-LN norm is taken
LN_SCALES = ("exact", "official")


@dataclass(frozen=True)
class ALTIPlusConventions:
    r"""The numerical conventions of one ALTI+ computation.

    Attributes:
        ln_scale: ``"exact"``: sigma_i = sqrt(Var_biased(u_i) + eps), the scale the norm really
            used (the parts then sum to the real output); ``"official"``: the official code's
            std_unbiased(u_i + eps) (the parts then sum to something slightly different).
        l1_eps: a constant added to every coordinate inside the L1 distance (the official
            code's ``F.pairwise_distance`` adds 1e-6), 0 for the plain L1 distance.
        renormalize_rollout: divide every row of the decoder rollout by its sum after each
            layer from the second on (the official code does; a no-op in exact arithmetic).
    """

    ln_scale: str = "exact"
    l1_eps: float = 0.0
    renormalize_rollout: bool = False

    def __post_init__(self) -> None:
        if self.ln_scale not in LN_SCALES:
            raise ValueError(f"ln_scale must be one of {LN_SCALES}, got {self.ln_scale!r}")
        if not (isinstance(self.l1_eps, (int, float)) and self.l1_eps >= 0):
            raise ValueError(f"l1_eps must be a number >= 0, got {self.l1_eps!r}")


#: the package's default: the exact norm scale and the plain L1 distance
DEFAULT = ALTIPlusConventions()
#: the official code's conventions (mt-upc/transformer-contributions-nmt)
OFFICIAL = ALTIPlusConventions(ln_scale="official", l1_eps=1e-6, renormalize_rollout=True)


def norm_scale(u: Tensor, norm: NormParams, ln_scale: str = "exact") -> Tensor:
    r"""The frozen scale sigma_i of a norm at its real input.

    Args:
        u: (..., D) the real input of the norm.
        norm: its parameters (``kind`` ``"layernorm"`` or ``"rmsnorm"``).
        ln_scale: ``"exact"`` (what the norm computes) or ``"official"`` (LayerNorm only:
            the unbiased std of u + eps, as the official ALTI+ code).

    Returns:
        (...,) sigma_i.
    """
    if norm.kind == "rmsnorm":
        if ln_scale != "exact":
            raise ValueError("the official ALTI+ scale convention is defined for LayerNorm only")
        return torch.sqrt(u.pow(2).mean(-1) + norm.eps)
    if ln_scale == "official":
        return (u + norm.eps).std(-1, unbiased=True)
    # Tensor.var, not decompose.primitives.layer_norm.norm_scale's faster norm of the centred input: in float32
    # it kept ALTI+ closer to float64 (measured: 8e-6 vs 1.3e-5 on the target scores, 96 + 80 tokens)
    return torch.sqrt(u.var(-1, unbiased=False) + norm.eps)


def block_contributions(
    probs: Tensor,
    values: Tensor,
    head_weight: Tensor,
    out_bias: Optional[Tensor],
    residual: Tensor,
    output: Tensor,
    valid_q: Tensor,
    valid_k: Tensor,
    cross: bool,
    norm: Optional[NormParams] = None,
    norm_input: Optional[Tensor] = None,
    conventions: ALTIPlusConventions = DEFAULT,
    chunk_rows: Optional[int] = None,
    causal: bool = False,
) -> Tuple[Tensor, Tensor]:
    r"""ALTI contributions of one attention block (self- or cross-attention) and its completeness error.

    The distances are computed by the shared ALTI kernel
    (:func:`~captum_normattr.decompose.methods.alti.alti_map`): the parts of the key tokens are never
    written out for more than one cache tile of query rows at a time (or not at all, by the
    compiled kernel); the cross-attention residual is one extra part per query.

    Args:
        probs: (B, H, Q, K) attention probabilities (masked keys exactly 0).
        values: (B, H, K, Dh) value states (b_V inside).
        head_weight: (H, Dh, D) W_O per head (right-multiplied).
        out_bias: (D,) b_O or None.
        residual: (B, Q, D) the residual r_i of every query.
        output: (B, Q, D) the real block output y_i (for the completeness error).
        valid_q: (B, Q) bool, real queries. valid_k: (B, K) bool, real keys.
        cross: False: self-attention (Q == K; r_i joins token i's part); True: cross-attention
            (r_i is an extra part, the last column of the result).
        norm: post-LN: the norm after the sum (parts are mapped through it with a frozen
            scale); None: pre-LN (the block output is the raw residual stream).
        norm_input: post-LN: (B, Q, D) the real input of that norm (gives the scale).
        conventions: :data:`DEFAULT` or :data:`OFFICIAL` (or a mix).
        chunk_rows: at most this many query rows per tile of the kernel (the memory rule of
            :func:`~captum_normattr.decompose.primitives.chunking.rows_for_budget`); None: no cap.
        causal: self-attention only: causal attention (decoder self-attention), row i has parts
            from j <= i only and the kernel skips the all-zero triangle. Exact (the skipped
            entries are 0 either way) only with ``conventions.l1_eps == 0``: the official +1e-6
            gives the all-zero parts small contributions, which this option would drop.

    Returns:
        (contributions (B, Q, K) for self-attention or (B, Q, K + 1) for cross-attention, valid
        rows summing to 1, pad rows and pad key columns exactly 0;
        completeness error (B,): the largest absolute difference, over the real queries,
        between the sum of all parts (bias part included) and the real output y_i).
    """
    b, _, q, k = probs.shape
    if not cross and q != k:
        raise ValueError(f"a self-attention block needs as many queries as keys, got {q} and {k}")
    if cross and causal:
        raise ValueError("causal applies to self-attention blocks only")
    if norm is not None and norm_input is None:
        raise ValueError("a post-LN block needs the real input of its norm (norm_input)")
    d = head_weight.shape[-1]
    lin = None if norm is None else NormLinearMap(norm, dim=d, dtype=values.dtype, device=values.device)
    # parts of key j in query i: sum_h A^h_ij v^h_j W_O^h (through the norm's linear part), token-major
    projected = project_values(values, head_weight, lin, token_major=True)  # (B, H, K, D)
    # their sum over the keys, the attention output, without the parts: (sum_j A^h_ij v^h_j) W_O^h
    context = torch.matmul(probs, values)  # (B, H, Q, Dh)
    total = torch.einsum("bhqe,hed->bqd", context, head_weight) + residual  # (B, Q, D)
    bias = out_bias if out_bias is not None else total.new_zeros(d)
    if norm is not None:
        sigma = norm_scale(norm_input, norm, conventions.ln_scale)  # (B, Q)
        res_part = lin.apply(residual)  # unscaled, as the key parts (the kernel divides by sigma)
        bias_part = lin.apply(bias) / sigma[..., None]
        if norm.bias is not None:
            bias_part = bias_part + norm.bias
        resultant = lin.apply(total) / sigma[..., None] + bias_part  # the decomposed block output
    else:
        sigma, res_part = None, residual
        resultant = total + bias
    gap = (resultant - output).abs().amax(-1).masked_fill(~valid_q, 0.0)
    err = gap.amax(-1)  # (B,)
    kw = dict(row_scale=sigma, chunk_rows=chunk_rows, valid_k=valid_k, l1_eps=conventions.l1_eps)
    if cross:
        c = alti_map(probs, projected, None, resultant, valid_q, extra_parts=res_part.unsqueeze(2), **kw)
    else:
        c = alti_map(probs, projected, res_part, resultant, valid_q, causal=causal, **kw)
    return c, err


def encoder_rollout(maps: Sequence[Tensor]) -> Tensor:
    r"""ALTI rollout of the encoder: R_1 = C_1, R_l = C_l R_{l-1} (no re-normalisation).

    Args:
        maps: per layer (B, S, S) contribution maps, first layer first.

    Returns:
        (B, S, S) R_L.
    """
    if not maps:
        raise ValueError("the encoder has no layers to roll out")
    joint = maps[0]
    for m in maps[1:]:
        joint = torch.matmul(m, joint)
    return joint


def alti_plus_rollout(
    self_maps: Sequence[Tensor],
    cross_maps: Sequence[Tensor],
    enc_rollout: Tensor,
    renormalize: bool = False,
    return_layers: bool = False,
) -> Tuple[Tensor, Tensor, Optional[List[Tensor]]]:
    r"""ALTI+ decoder rollout over [source tokens | decoder-input tokens].

    Layer l: M_l = [C^cross_l[:, :S] R^enc | diag(rho_l) C^self_l], rho_l = C^cross_l[:, S]
    (the share of the residual stream). R_1 = M_1 and
    R_l = [M^src_l + M^tgt_l R^src_{l-1} | M^tgt_l R^tgt_{l-1}].

    Args:
        self_maps: per decoder layer (B, T, T) C^self_l.
        cross_maps: per decoder layer (B, T, S + 1) C^cross_l (last column: the residual).
        enc_rollout: (B, S, S) R^enc (the encoder's final rollout; every cross-attention
            reads the final encoder output).
        renormalize: divide every row by its sum after each layer from the second on (the
            official code; a no-op in exact arithmetic; zero rows stay zero).
        return_layers: also return the rollout after every layer.

    Returns:
        (R^src (B, T, S), R^tgt (B, T, T), the per-layer (B, T, S + T) rollouts or None).
    """
    if len(self_maps) != len(cross_maps) or not self_maps:
        raise ValueError(f"need as many self- as cross-attention maps (>= 1), got {len(self_maps)} and {len(cross_maps)}")
    layers: List[Tensor] = []
    r_src = r_tgt = None
    for l, (c_self, c_cross) in enumerate(zip(self_maps, cross_maps)):
        r_src, r_tgt = alti_plus_rollout_step(r_src, r_tgt, c_self, c_cross, enc_rollout, renormalize, layer=l)
        if return_layers:
            layers.append(torch.cat([r_src, r_tgt], dim=-1))
    return r_src, r_tgt, (layers if return_layers else None)


def alti_plus_rollout_step(
    r_src: Optional[Tensor],
    r_tgt: Optional[Tensor],
    c_self: Tensor,
    c_cross: Tensor,
    enc_rollout: Tensor,
    renormalize: bool = False,
    layer: int = 0,
) -> Tuple[Tensor, Tensor]:
    r"""One decoder layer of :func:`alti_plus_rollout`: the rollout after layer l from the one after l - 1.

    The streamed form: a decoder layer's maps can be rolled in as soon as the layer has run.

    Args:
        r_src, r_tgt: (B, T, S), (B, T, T) the rollout after the previous layer, or None
            before the first layer.
        c_self: (B, T, T) C^self_l. c_cross: (B, T, S + 1) C^cross_l.
        enc_rollout: (B, S, S) R^enc.
        renormalize: see :func:`alti_plus_rollout` (not applied at the first layer).
        layer: the layer index, for the error message.

    Returns:
        (R^src, R^tgt) after layer l.
    """
    s = enc_rollout.shape[-1]
    if c_cross.shape[-1] != s + 1:
        raise ValueError(f"cross-attention map of layer {layer} has {c_cross.shape[-1]} columns, expected S + 1 = {s + 1}")
    m_src = torch.matmul(c_cross[..., :s], enc_rollout)
    m_tgt = c_cross[..., s:] * c_self
    if r_src is None:
        return m_src, m_tgt
    r_src = m_src + torch.matmul(m_tgt, r_src)
    r_tgt = torch.matmul(m_tgt, r_tgt)
    if renormalize:
        sums = r_src.sum(-1, keepdim=True) + r_tgt.sum(-1, keepdim=True)
        ok = sums > 0
        denom = torch.where(ok, sums, torch.ones_like(sums))
        r_src = (r_src / denom).masked_fill(~ok, 0.0)
        r_tgt = (r_tgt / denom).masked_fill(~ok, 0.0)
    return r_src, r_tgt
