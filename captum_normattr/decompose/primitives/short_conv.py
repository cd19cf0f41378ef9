r"""The gated short-convolution mixer (LFM2) as a per-channel mixing tensor (``docs/frontier.md``).

LFM2's ``Lfm2ShortConv`` computes, per channel c, from its input projection's three slices
[B | C | x] (B_s, C_t the gates, x_s the values) and a causal depthwise convolution of kernel
w[c, k] (k = 0 .. K - 1, the last tap on the current token):

    y_{t,c} = C_{t,c} sum_{s = t - K + 1}^{t} w[c, K - 1 - (t - s)] B_{s,c} x_{s,c}.

With B and C taken from the real forward pass, y is linear in the values x: y_{t,c} =
sum_s G[c, t, s] x_{s,c} with G[c, t, s] = C_{t,c} w[c, K - 1 - (t - s)] B_{s,c} for
0 <= t - s < K and 0 elsewhere (causal, inside the window). :func:`short_conv_mixing` builds G
as attention probabilities with one head per channel (B, C, T, T); the values become (B, C, T, 1)
and the output projection (C, D) is one row per head, so every layer kind decomposes the mixer
as attention with head size 1.

Cost: the dense G (B, C, T, T) has only K non-zero diagonals; the capture records it factored
(:func:`short_conv_channel_mixing`, a :class:`~captum_normattr.decompose.primitives.channel_mixing.ChannelMixing`
with no token mixing: the gates and the kernel, O(T C) numbers), whose blocks of rows are banded.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.channel_mixing import ChannelMixing

__all__ = ["short_conv_channel_mixing", "short_conv_mixing"]


def short_conv_mixing(b_gate: Tensor, c_gate: Tensor, kernel: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    r"""The per-channel mixing tensor G of a gated short convolution (see the module docstring).

    Args:
        b_gate: (B, T, C) the input gate B_s (the first slice of the input projection's output).
        c_gate: (B, T, C) the output gate C_t (the second slice).
        kernel: (C, K) the depthwise convolution's kernel (``conv.weight`` squeezed), tap K - 1 on
            the current token.
        valid: (B, T) bool, the tokens the model does not mask out (LFM2 zeroes the mixer input of
            padding tokens), or None.

    Returns:
        (B, C, T, T) G[b, c, t, s] = C_{t,c} w[c, K - 1 - (t - s)] B_{s,c} for 0 <= t - s < K, else 0.

    Examples::

        >>> g = short_conv_mixing(torch.ones(1, 4, 2), torch.ones(1, 4, 2), torch.ones(2, 3))
        >>> g.shape
        torch.Size([1, 2, 4, 4])
    """
    b, t, c = b_gate.shape
    k = kernel.shape[-1]
    kernel = kernel.reshape(c, k).to(b_gate.dtype)
    lag = torch.arange(t, device=b_gate.device)[:, None] - torch.arange(t, device=b_gate.device)[None, :]  # t - s
    inside = (lag >= 0) & (lag < k)
    taps = kernel[:, (k - 1 - lag).clamp(0, k - 1)] * inside.to(kernel.dtype)  # (C, T, T)
    source = b_gate if valid is None else b_gate * valid[..., None].to(b_gate.dtype)
    return c_gate.transpose(1, 2)[..., :, None] * taps[None] * source.transpose(1, 2)[..., None, :]


def short_conv_channel_mixing(b_gate: Tensor, c_gate: Tensor, kernel: Tensor,
                              valid: Optional[Tensor] = None) -> ChannelMixing:
    r"""The G of :func:`short_conv_mixing`, factored: the output gate per target, the input gate per source, the kernel.

    Args: as :func:`short_conv_mixing`.

    Returns:
        A :class:`~captum_normattr.decompose.primitives.channel_mixing.ChannelMixing` (no token mixing: the identity)
        whose dense tensor is :func:`short_conv_mixing`'s.

    Examples::

        >>> g = short_conv_channel_mixing(torch.ones(1, 4, 2), torch.ones(1, 4, 2), torch.ones(2, 3))
        >>> torch.equal(g.dense(), short_conv_mixing(torch.ones(1, 4, 2), torch.ones(1, 4, 2), torch.ones(2, 3)))
        True
    """
    c = b_gate.shape[-1]
    source = b_gate if valid is None else b_gate * valid[..., None].to(b_gate.dtype)
    return ChannelMixing(None, [(0, 0, c)], kernel.reshape(c, -1).to(b_gate.dtype), None, c_gate, source)
