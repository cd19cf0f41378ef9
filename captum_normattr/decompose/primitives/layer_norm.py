r"""LayerNorm and RMSNorm applied to a sum of parts (docs/design.md, section 3).

A norm is not linear, but once the scale of the REAL full input is fixed it is: every
part u_k maps to gamma * c(u_k) / s(u) (LayerNorm) or gamma * u_k / rms(u) (RMSNorm),
and the bias part additionally receives beta. The parts then sum to the real output.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from captum_normattr.decompose.primitives import chunking
from captum_normattr.decompose.records import NormParams

__all__ = ["NormLinearMap", "apply_norm_to_parts", "norm_bias_part", "norm_linear_map", "norm_scale"]


def norm_scale(u: Tensor, params: NormParams) -> Tensor:
    r"""The per-token denominator of a norm, computed from its real input.

    Args:
        u: the real input of the norm, (..., D).
        params: the norm's parameters.

    Returns:
        s(u) = sqrt(var(u) + eps) (biased variance) for LayerNorm, or
        rms(u) = sqrt(mean(u^2) + eps) for RMSNorm, shape (...,); ones for the ``identity``
        norm (a branch without a pre-norm).
    """
    d = u.shape[-1]
    if params.kind == "identity":
        return torch.ones(u.shape[:-1], dtype=u.dtype, device=u.device)
    if u.requires_grad or u.numel() * u.element_size() <= chunking.VECTOR_BLOCK_BYTES:
        return _norm_scale_rows(u, params)
    # blocks of tokens: the centred copy of a block stays in the CPU cache (one read of u from memory)
    flat = u.reshape(-1, d)
    out = u.new_empty(flat.shape[0])
    for rows in chunking.token_blocks(flat.shape[0], d * u.element_size()):
        out[rows] = _norm_scale_rows(flat[rows], params)
    return out.view(u.shape[:-1])


def _norm_scale_rows(u: Tensor, params: NormParams) -> Tensor:
    if params.kind == "identity":  # an nn.Identity in a norm's place (ModernBERT's first attention norm)
        return torch.ones(u.shape[:-1], dtype=u.dtype, device=u.device)
    if params.kind == "rmsnorm":
        return torch.sqrt(u.pow(2).mean(-1) + params.eps)
    # the biased variance as a norm of the centred input: same value, several times faster than
    # Tensor.var on CPU
    c = u - u.mean(-1, keepdim=True)
    return torch.sqrt(torch.linalg.vector_norm(c, dim=-1).pow_(2).div_(u.shape[-1]).add_(params.eps))


def norm_linear_map(params: NormParams, dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    r"""The fixed linear part of a norm as a right-multiplied (D, D) matrix.

    For LayerNorm it is C diag(gamma), with C = I - 11^T/D the centering matrix; for
    RMSNorm it is diag(gamma). Divide by :func:`norm_scale` per token afterwards.

    Args:
        params: the norm's parameters.
        dim: D.
        dtype, device: of the result.

    Returns:
        (D, D) matrix A such that part_out = part_in @ A / s.
    """
    gamma = params.weight if params.weight is not None else torch.ones(dim, dtype=dtype, device=device)
    gamma = gamma.to(dtype=dtype, device=device)
    if params.kind != "layernorm":  # RMSNorm, identity: no centering
        return torch.diag(gamma)
    center = torch.eye(dim, dtype=dtype, device=device) - 1.0 / dim
    return center * gamma.unsqueeze(0)


class NormLinearMap:
    r"""The fixed linear parts of one or more norms applied in turn, as a right-multiplied operator.

    ``x @ NormLinearMap(ln1, ln2, dim=D, ...)`` equals ``x @ norm_linear_map(ln1) @ norm_linear_map(ln2)``
    but costs O(D) per vector instead of O(D^2): centering (LayerNorm) and the gamma
    scaling are applied along the last dimension. :meth:`dense` gives the (D, D) matrix;
    ``A @ B`` chains two maps (or multiplies by a matrix).

    Args:
        *params: the norms, first applied first.
        dim: D.
        dtype, device: of the gammas.

    Examples::

        >>> A = NormLinearMap(ln1, ln2, dim=8, dtype=torch.float64, device="cpu")
        >>> torch.allclose(x @ A, x @ A.dense())
        True
    """

    def __init__(self, *params: NormParams, dim: int, dtype: torch.dtype, device) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        self.steps = [
            (p.kind == "layernorm", None if p.weight is None else p.weight.to(dtype=dtype, device=device)) for p in params
        ]

    def apply(self, x: Tensor) -> Tensor:
        r"""x @ A along the last dimension (a new tensor)."""
        for center, gamma in self.steps:
            x = x - x.mean(-1, keepdim=True) if center else x
            x = x * gamma if gamma is not None else x
        return x

    def dense(self) -> Tensor:
        r"""A as a (D, D) matrix."""
        return self.apply(torch.eye(self.dim, dtype=self.dtype, device=self.device))

    def __rmatmul__(self, x: Tensor) -> Tensor:
        return self.apply(x)

    def __matmul__(self, other):
        if isinstance(other, NormLinearMap):
            out = NormLinearMap(dim=self.dim, dtype=self.dtype, device=self.device)
            out.steps = self.steps + other.steps
            return out
        return self.dense() @ other


def apply_norm_to_parts(parts: Tensor, real_input: Tensor, params: NormParams) -> Tensor:
    r"""Map parts of a norm's input to parts of its output (bias part excluded).

    Args:
        parts: (B, T, ..., D) parts of the input of token i; dim 1 indexes the token
            whose norm is applied; the trailing dims between are parts (e.g. source
            tokens).
        real_input: (B, T, D) the real full input of the norm.
        params: the norm's parameters.

    Returns:
        Parts of the output, same shape as ``parts``. Add :func:`norm_bias_part` of the
        input's bias part to complete the real output.
    """
    scale = norm_scale(real_input, params)  # (B, T)
    scale = scale.reshape(scale.shape + (1,) * (parts.dim() - 2))
    if params.kind != "layernorm":  # RMSNorm, identity: no centering
        out = parts
    else:
        out = parts - parts.mean(-1, keepdim=True)
    if params.weight is not None:
        out = out * params.weight.to(out.dtype)
    return out / scale


def norm_bias_part(bias_in: Optional[Tensor], real_input: Tensor, params: NormParams) -> Tensor:
    r"""The bias part of a norm's output: gamma * c(u_bias) / s(u) + beta.

    Args:
        bias_in: (B, T, D) or (D,) bias part of the input, or None (zero).
        real_input: (B, T, D) the real full input.
        params: the norm's parameters.

    Returns:
        (B, T, D).
    """
    if bias_in is None:
        bias_in = torch.zeros_like(real_input)
    bias_in = torch.broadcast_to(bias_in, real_input.shape)
    out = apply_norm_to_parts(bias_in, real_input, params)
    if params.bias is not None:
        out = out + params.bias.to(out.dtype)
    return out
