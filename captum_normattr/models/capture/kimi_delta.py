r"""Hooks that record a Kimi Delta Attention mixer (Kimi Linear) as attention with one head per value channel.

Kimi Delta Attention (transformers ``KimiLinearDeltaAttention``) mixes tokens through a gated delta rule
whose decay is per key channel (``docs/linear_mixers.md``, "Kimi Delta Attention"). With its coefficients
taken from the real forward pass (the q and k projections through their causal convolutions, SiLUs and L2
norms, the value convolution's SiLU slope, the per-channel decays of ``forget_gate``, the writing strengths
sigmoid(``b_proj``) and the sigmoid-gated output norm's per-target scale), its output before ``o_proj`` is
sum_s G[t, s, c] u[s, c] with u the value projection's output (before the convolution), exactly:
:func:`~captum_normattr.decompose.primitives.linear_mixers.delta_rule_mixing` then
:func:`~captum_normattr.decompose.primitives.linear_mixers.conv_composed_mixing`. G is recorded as the
probabilities (B, C, T, T) kept factored (``ChannelMixing``), u as the values (B, C, T, 1) and the output projection's input as the
context (B, T, C, 1), as the short convolution is (:meth:`~captum_normattr.models.capture.recorder.Recorder._short_conv_hooks`).

Padding: the module zeroes its input at the tokens its 2-D mask drops, so their values are 0 in the real pass;
their columns of G are zeroed too (the decompositions read the values as a linear map of the un-masked norm
output), and a left-padded example gets the G it has alone. G rebuilt against the module's real output is one
of the layer's consistency checks (a cached continuation, or kernels that compute in float32, show there).
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec
from captum_normattr.decompose.primitives.channel_mixing import ChannelMixing
from captum_normattr.decompose.primitives.linear_mixers import delta_rule_mixing, silu_slope
from captum_normattr.models.adapters import get_path
from captum_normattr.models.capture.record import input_keeper

__all__ = ["KDA_PARTS", "kimi_delta_hooks", "kimi_delta_mixing"]

#: the delta-attention module's submodules the capture reads (attributes of the mixer module)
KDA_PARTS = ("q_proj", "k_proj", "v_proj", "forget_gate", "b_proj", "o_norm")
#: the name of the consistency check of G against the module's real output
REBUILD_CHECK = "Kimi delta attention output vs its mixing rebuilt from the recorded coefficients"


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    r"""Kimi's (FLA's) L2 norm: x / sqrt(sum x^2 + eps)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kimi_delta_mixing(q_in: Tensor, k_in: Tensor, v_in: Tensor, conv_weight: Tensor, log_decay: Tensor, b: Tensor,
                      core: Tensor, gate: Tensor, norm_weight: Tensor, norm_eps: float,
                      valid: Any = None) -> ChannelMixing:
    r"""The per-channel mixing tensor G (B, C, T, S) of one Kimi Delta Attention call over its value projection's output.

    Kept factored (:class:`~captum_normattr.decompose.primitives.channel_mixing.ChannelMixing`): the per-head
    delta-rule mixing, the value convolution, its SiLU slope, the gated norm's scale and the padding columns.

    Args:
        q_in, k_in, v_in: (B, T, C) the q, k and v projections' outputs (before the convolution).
        conv_weight: (3 C, K) the depthwise kernel over [q | k | v] (``conv1d.weight[:, 0]``).
        log_decay: (B, T, H, d) the forget gate's output (the log decay per key channel, <= 0).
        b: (B, T, H) ``b_proj``'s output (beta = sigmoid(b)).
        core: (B, T, H, d) the delta rule's output, the gated norm's input.
        gate: (B, T, H, d) the gated norm's gate.
        norm_weight: (d,) the gated norm's weight.
        norm_eps: its epsilon.
        valid: (B, T) bool, the tokens the module keeps (None: all); the columns of the others are 0.

    Returns:
        G (B, C, T, S), factored: ``out_norm[t, c] = sum_s G[b, c, t, s] v_in[s, c]`` (``G.context``).

    Examples::

        >>> g = kimi_delta_mixing(q, k, v, w, log_decay, b, core, gate, weight, 1e-6)  # doctest: +SKIP
    """
    batch, length, channels = v_in.shape
    heads, head_dim = log_decay.shape[2], log_decay.shape[3]
    if heads * head_dim != channels or conv_weight.shape[0] != 3 * channels:
        raise ValueError(f"Kimi delta attention: {channels} value channels, {heads} heads of {head_dim} and a "
                         f"convolution over {conv_weight.shape[0]} channels do not match")
    kernel = conv_weight.shape[1]
    pre = F.conv1d(torch.cat([q_in, k_in, v_in], -1).transpose(1, 2), conv_weight.unsqueeze(1), padding=kernel - 1,
                   groups=3 * channels)[..., :length].transpose(1, 2)
    pre_q, pre_k, pre_v = pre.split(channels, dim=-1)
    query = _l2norm(F.silu(pre_q).reshape(batch, length, heads, head_dim))
    key = _l2norm(F.silu(pre_k).reshape(batch, length, heads, head_dim))
    mixing = delta_rule_mixing(query, key, torch.sigmoid(b), log_decay)
    # the gated RMSNorm per head: w * core / rms(core) * sigmoid(gate), held at its recorded statistics
    scale = norm_weight * torch.sigmoid(gate) * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + norm_eps)
    source = None if valid is None else valid[..., None].to(v_in.dtype).expand(batch, length, channels)
    return ChannelMixing(mixing, [(h, h * head_dim, (h + 1) * head_dim) for h in range(heads)],
                         conv_weight[2 * channels:], silu_slope(pre_v), scale.reshape(batch, length, channels), source)


def kimi_delta_hooks(recorder: Any, idx: int, layer: nn.Module, la: ArchitectureSpec) -> list:
    r"""Register the hooks that record layer ``idx``'s Kimi Delta Attention mixer; return their handles.

    Args:
        recorder: the :class:`~captum_normattr.models.capture.recorder.Recorder` (its ``record_attention``,
            ``_check``, ``_mine``, ``dtype`` and ``record_probabilities``).
        idx: the layer index.
        layer: the layer module.
        la: the layer's description (its attention branch is the ``kimi_delta`` mixer).

    Returns:
        The hook handles.

    Raises:
        ValueError: the mixer module lacks one of :data:`KDA_PARTS` or its convolution.
    """
    mixer = la.layer.attention
    module = get_path(layer, mixer.module)
    missing = [p for p in KDA_PARTS if not isinstance(getattr(module, p, None), nn.Module)]
    if missing:
        raise ValueError(f"the {la.family} description records {type(module).__name__} as Kimi delta attention, "
                         f"which has no {missing} (the parts it reads: {', '.join(KDA_PARTS)})")
    conv = get_path(layer, mixer.conv)
    got: Dict[str, Any] = {}

    def keep(name: str, inputs: bool = False):
        def hook(mod, args, output):
            if recorder._mine():
                got[name] = tuple(a.detach() for a in args[:2]) if inputs else output.detach()
        return hook

    def keep_mask(mod, args, kwargs):
        if recorder._mine():
            got.clear()
            got["mask"] = (kwargs or {}).get("attention_mask")

    keep_context = input_keeper(recorder._mine, got)

    def record(mod, args, output):
        if not recorder._mine():
            return
        parts = {k: got.pop(k, None) for k in ("q", "k", "v", "g", "b", "norm", "context", "mask")}
        absent = [k for k in ("q", "k", "v", "g", "b", "norm", "context") if parts[k] is None]
        if absent:
            raise RuntimeError(f"layer {idx}: the {la.family} Kimi delta attention did not run its parts {absent}; "
                               "the description does not match the model")
        dt = recorder.dtype
        v = parts["v"]
        b, t, c = v.shape
        ctx = parts["context"].reshape(b, t, c)
        mask = parts["mask"]
        valid = mask.to(torch.bool) if isinstance(mask, Tensor) and mask.dim() == 2 else None
        probs = None
        if recorder.record_probabilities:
            core, gate = parts["norm"]
            norm = module.o_norm
            probs = kimi_delta_mixing(
                parts["q"].to(dt), parts["k"].to(dt), v.to(dt), conv.weight.detach()[:, 0].to(dt), parts["g"].to(dt),
                parts["b"].to(dt), core.to(dt), gate.to(dt), norm.weight.detach().to(dt),
                float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))), valid)
            rebuilt = probs.context(v.to(dt))
            recorder._check(idx, REBUILD_CHECK, ctx, rebuilt)
        recorder.record_attention(mod, probs, v.transpose(1, 2).unsqueeze(-1), ctx.reshape(b, t, c, 1))

    handles = [module.register_forward_pre_hook(keep_mask, with_kwargs=True)]
    for name, part in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("g", "forget_gate"), ("b", "b_proj")):
        handles.append(getattr(module, part).register_forward_hook(keep(name)))
    handles.append(module.o_norm.register_forward_hook(keep("norm", inputs=True)))
    handles.append(get_path(layer, mixer.out).register_forward_pre_hook(keep_context))
    handles.append(module.register_forward_hook(record))
    return handles
