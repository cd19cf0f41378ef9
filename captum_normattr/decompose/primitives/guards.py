r"""Consistency checks between the recorded tensors and what a decomposition assumes (pure math).

A decomposition is exact for the computation it assumes: the attention reads the layer input
(post-LN) or the first norm's output (pre-LN), each norm is the LayerNorm/RMSNorm its
parameters describe, the residual joins add what they should, one layer's output is the next
layer's input. A hook, a patched module or a wrong architecture description can break any of
these while every completeness error stays at rounding level. The functions here measure how
far the model's real tensors are from the assumed ones, relative to the real tensor's scale
(``docs/reliability.md``, "Consistency guards").
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from captum_normattr.decompose.records import NormParams

__all__ = [
    "GUARD_TOLERANCE",
    "GUARD_TOLERANCE_LOW_PRECISION",
    "guard_tolerance",
    "norm_rebuild_error",
    "rebuild_norm",
    "relative_difference",
]


def relative_difference(real: Tensor, expected: Tensor, temporary: bool = False) -> Tensor:
    r"""max |real - expected| / max |real|, a 0-dim tensor (in the dtype of ``real``).

    Both are compared in the dtype of ``real`` (``expected`` is cast and reshaped to it). A
    real tensor that is exactly 0 everywhere gives the absolute difference divided by the
    smallest normal number (any difference is then far above every tolerance).
    ``temporary``: ``expected`` is a temporary of the caller's, overwritten with the difference.
    """
    cast = expected.to(dtype=real.dtype, device=real.device)
    owned = temporary or cast.data_ptr() != expected.data_ptr()  # a copy made here may be overwritten
    cast = cast.reshape(real.shape)
    diff = cast.sub_(real) if owned else cast - real
    return _abs_max(diff) / _abs_max(real).clamp_min(torch.finfo(real.dtype).tiny)


def _abs_max(x: Tensor) -> Tensor:
    lo, hi = torch.aminmax(x)  # one pass, no temporary (abs().amax() allocates one; vector_norm(inf) is slow on CPU)
    return torch.maximum(hi, -lo)


def rebuild_norm(x: Tensor, params: NormParams) -> Tensor:
    r"""The output of the norm ``params`` describes, from its real input ``x`` (..., D).

    LayerNorm: gamma * (x - mean) / sqrt(var + eps) + beta; RMSNorm: gamma * x / sqrt(mean(x^2) + eps).
    """
    d = x.shape[-1]
    if params.kind == "identity":  # a branch without a pre-norm (a new tensor: callers may reuse it in place)
        return x.clone()
    weight = None if params.weight is None else params.weight.to(x.dtype)
    if params.kind == "rmsnorm":
        return F.rms_norm(x, (d,), weight, params.eps)
    bias = None if params.bias is None else params.bias.to(x.dtype)
    return F.layer_norm(x, (d,), weight, bias, params.eps)


def norm_rebuild_error(real_in: Tensor, real_out: Tensor, params: NormParams) -> Tensor:
    r"""Relative difference between a norm's real output and its output rebuilt from its real input."""
    return relative_difference(real_out, rebuild_norm(real_in, params), temporary=True)


#: the relative difference tolerated between a real tensor and the assumed one, by the dtype
#: the model computes in (see docs/reliability.md: rounding of that dtype, with a wide margin)
GUARD_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3}
#: for 16-bit and other dtypes
GUARD_TOLERANCE_LOW_PRECISION = 3e-2


def guard_tolerance(dtype: torch.dtype) -> float:
    r"""The relative tolerance of the consistency checks for tensors the model computed in ``dtype``."""
    return GUARD_TOLERANCE.get(dtype, GUARD_TOLERANCE_LOW_PRECISION)
