r"""Recording a Mamba-2 mixer (Granite 4) as attention with one head of size 1 per channel.

transformers' Mamba-2 mixer (``GraniteMoeHybridMambaLayer``; the torch path, no CUDA kernels)
computes, from its input projection's output [z | x | B | C | dt] (``in_proj``),

    a = conv1d([x | B | C]) (depthwise, causal),  [x' | B' | C'] = silu(a) * mask,
    y_t = sum_{s <= t} M[t, s] x'_s  (the SSD scan, D skip inside M),
    out_t = gated_rmsnorm(y_t, z_t) W_out,

with M[t, s] = (C'_t . B'_s) exp(sum_{r = s+1}^{t} dt_r A) dt_s + D [s = t] per head. With the
time steps dt (after ``dt_bias``, softplus and ``time_step_limit``), A = -exp(A_log), B', C',
the SiLU slope sigmoid(a_x) of the x channels and the gated norm's per-target scale (from the
norm's real input and gate) taken from the real forward pass, the output projection's input is
linear in the x channels u of ``in_proj`` before the convolution:
sum_s G[c, t, s] u_{s, c} (:func:`~captum_normattr.decompose.primitives.linear_mixers.conv_composed_mixing`).
The hooks here record G as the probabilities (B, C, T, T), kept factored
(:class:`~captum_normattr.decompose.primitives.channel_mixing.ChannelMixing`), u as the values (B, C, T, 1) and the
output projection's real input as the context (B, T, C, 1); every layer kind then decomposes
the mixer as attention with head size 1 (``docs/linear_mixers.md``, "Wiring Mamba-2 into the
families").

Padding: the mixer zeroes its input and its convolution's output at padding tokens (the 2-D mask
it is called with), so a padding token's values never reach a real token; G's columns of the
padding tokens are set to 0, and a left-padded example's G equals the example's alone.

A convolution bias b (``use_conv_bias`` / ``mamba_conv_bias=True``) adds, for target t and channel
c, sum_s P[c, t, s] b_c with P[c, t, s] = gamma_{t,c} M[t, s] sigma_{s,c}: the bias enters the scan
at position s inside the value x'_s, so the part P[c, t, s] b_c belongs to token s, as attention's
b_V belongs to the token whose value it is in (``docs/linear_mixers.md``, "The convolution bias").
It is recorded as C more heads of size 1: probabilities P (zero at padding sources, whose slope
the mixer zeroes), values b_c at every token, W_O the output projection's rows again
(:func:`mamba2_bias_heads`).

Guard: sum_s G[t, s] u_s (+ P[t, s] b) is compared with the output projection's real input (a
hook, a patched module or a wrong description shows there).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec
from captum_normattr.decompose.primitives.channel_mixing import ChannelMixing
from captum_normattr.decompose.primitives.linear_mixers import gated_rmsnorm_scale, ssd_mixing
from captum_normattr.models.adapters import get_path
from captum_normattr.models.capture.record import input_keeper

__all__ = ["MAMBA2_CHECK", "mamba2_bias_heads", "mamba2_hooks", "mamba2_mixing_from_projection", "mamba2_values_with_bias"]

#: the check comparing the output projection's real input with the recorded mixing applied to the values
MAMBA2_CHECK = "Mamba-2 output projection input vs the recorded mixing applied to the values"


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


def mamba2_mixing_from_projection(mixer: nn.Module, projection: Tensor, core: Tensor, gate: Tensor,
                                  valid: Any, dtype: torch.dtype) -> ChannelMixing:
    r"""The per-channel mixing G (B, C, T, T) of one Mamba-2 mixer from its real input projection and norm input.

    Kept factored (:class:`~captum_normattr.decompose.primitives.channel_mixing.ChannelMixing`): the per-head SSD
    mixing (the D skip inside), the x channels' convolution, its SiLU slope, the gated norm's scale and the
    padding columns.

    Args:
        mixer: the Mamba-2 module (``intermediate_size``, ``n_groups``, ``ssm_state_size``, ``num_heads``,
            ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``time_step_limit``, ``norm``).
        projection: (B, T, 2 I + 2 G N + H) the real output of its ``in_proj``.
        core: (B, T, I) the real input of its gated norm (the scan output).
        gate: (B, T, I) the norm's gate z.
        valid: (B, T) bool, the tokens the mixer does not zero (its 2-D mask), or None.
        dtype: the compute dtype.

    Returns:
        (B, C, T, T) G[b, c, t, s], zero at padding sources; ``out_proj`` of
        ``sum_s G[c, t, s] u_{s, c}`` is the mixer's output (``u`` the x slice of ``projection``).
        With a convolution bias (B, 2 C, T, T): G, then the bias heads P[c, t, s] =
        gamma_{t,c} M[t, s] sigma_{s,c} (:func:`mamba2_bias_heads`), and the output is
        ``out_proj`` of ``sum_s G[c, t, s] u_{s, c} + P[c, t, s] b_c``.
    """
    conv = mixer.conv1d
    inner, groups, state, heads = (int(mixer.intermediate_size), int(mixer.n_groups), int(mixer.ssm_state_size),
                                   int(mixer.num_heads))
    proj = projection.detach().to(dtype)
    device = proj.device
    batch, length, _ = proj.shape
    conv_dim = inner + 2 * groups * state
    _, xbc, dt_raw = proj.split([inner, conv_dim, heads], dim=-1)
    weight = conv.weight.detach().to(device=device, dtype=dtype).reshape(conv_dim, -1)  # (C, K), tap K-1 current
    kernel = weight.shape[1]
    bias = None if conv.bias is None else conv.bias.detach().to(device=device, dtype=dtype)
    pre = F.conv1d(xbc.transpose(1, 2), weight.unsqueeze(1), bias, padding=kernel - 1, groups=conv_dim)
    pre = pre[..., :length].transpose(1, 2)  # the convolution's output before the SiLU (the bias inside B, C, sigma)
    pre_x, pre_b, pre_c = pre.split([inner, groups * state, groups * state], dim=-1)
    keep = None if valid is None else valid.to(device=device, dtype=dtype)[..., None]
    b_in, c_out, slope = F.silu(pre_b), F.silu(pre_c), torch.sigmoid(pre_x)  # silu(a) = sigmoid(a) * a
    if keep is not None:  # the mixer zeroes the convolution's output at padding tokens
        b_in, c_out, slope = b_in * keep, c_out * keep, slope * keep
    dt = dt_raw + mixer.dt_bias.detach().to(device=device, dtype=dtype)
    dt = F.softplus(dt)
    low, high = tuple(mixer.time_step_limit) if mixer.time_step_limit is not None else (0.0, float("inf"))
    dt = torch.clamp(dt, min=low, max=high)
    a = -torch.exp(mixer.A_log.detach().float()).to(device=device, dtype=dtype)  # as the mixer computes it
    d = mixer.D.detach().to(device=device, dtype=dtype)
    mixing = ssd_mixing(dt, a, b_in.reshape(batch, length, groups, state), c_out.reshape(batch, length, groups, state), d)
    norm = mixer.norm
    scale = gated_rmsnorm_scale(core.detach().to(device=device, dtype=dtype), gate.detach().to(device=device, dtype=dtype),
                                norm.weight.detach().to(device=device, dtype=dtype), float(norm.variance_epsilon),
                                int(norm.group_size), norm_before_gate=False)
    head_dim = inner // heads
    ranges = [(h, h * head_dim, (h + 1) * head_dim) for h in range(heads)]
    source = None if keep is None else keep.expand(batch, length, inner)  # a padding token's values never reach the scan
    if conv.bias is None:
        return ChannelMixing(mixing, ranges, weight[:inner], slope, scale, source)
    # the bias heads P[c, t, s] = gamma_{t,c} M_{h(c)}[t, s] sigma_{s,c}: the current tap alone, no source scale
    # (``slope`` is already 0 at padding tokens)
    current = torch.zeros_like(weight[:inner])
    current[:, -1] = 1
    return ChannelMixing(mixing, ranges + [(h, inner + n0, inner + n1) for h, n0, n1 in ranges],
                         torch.cat([weight[:inner], current]), torch.cat([slope, slope], -1),
                         torch.cat([scale, scale], -1),
                         None if source is None else torch.cat([source, torch.ones_like(source)], -1))


def mamba2_bias_heads(mixer: nn.Module, values: Tensor, context: Tensor, from_bias: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Values and context of a Mamba-2 mixer with a convolution bias, recorded with the bias as C more heads.

    The bias b_c of the x channels enters the scan at every position s inside the value
    x'_s = sigma_{s,c} (conv(u)_{s,c} + b_c); the part that reaches target t, P[c, t, s] b_c, belongs to
    token s, as attention's b_V belongs to the token whose value holds it (``docs/linear_mixers.md``,
    "The convolution bias"). Heads C..2C-1 have the value b_c at every token and the probabilities P
    (the second half of :func:`mamba2_mixing_from_projection`'s output); their W_O rows are the output
    projection's again and their W_V columns 0 with b_V = b
    (:func:`~captum_normattr.models.adapters.value_projection`).

    Args:
        mixer: the Mamba-2 module (its ``conv1d.bias``, ``intermediate_size``).
        values: (B, C, T, 1) the x slice of the input projection.
        context: (B, T, C) the output projection's real input.
        from_bias: (B, T, C) the bias heads' context sum_s P[c, t, s] b_c (the last C channels of
            ``probs.context`` with the values of :func:`mamba2_values_with_bias`).

    Returns:
        ``(values (B, 2 C, T, 1), context (B, T, 2 C, 1))``: the bias heads' context is
        sum_s P[c, t, s] b_c, the first C heads' the real input minus it (their sum is the real input).

    Examples::

        >>> values, context = mamba2_bias_heads(mixer, u.transpose(1, 2)[..., None], ctx, from_bias)
    """
    full = mamba2_values_with_bias(mixer, values[..., 0].transpose(1, 2).to(from_bias.dtype))  # (B, T, 2 C)
    ctx = context.to(from_bias.dtype)
    return full.transpose(1, 2).unsqueeze(-1), torch.cat([ctx - from_bias, from_bias], dim=-1).unsqueeze(-1)


def mamba2_values_with_bias(mixer: nn.Module, u: Tensor) -> Tensor:
    r"""[u | b] (B, T, 2 C): the x channels and, as the bias heads' values, the convolution bias at every token."""
    inner = int(mixer.intermediate_size)
    bias = mixer.conv1d.bias.detach()[:inner].to(device=u.device, dtype=u.dtype)
    return torch.cat([u, bias.expand(*u.shape[:2], inner)], dim=-1)


def mamba2_hooks(recorder: Any, idx: int, layer: nn.Module, la: ArchitectureSpec) -> list:
    r"""Hooks that record the Mamba-2 mixer of layer ``idx`` as attention with one head per channel.

    Args:
        recorder: the :class:`~captum_normattr.models.capture.recorder.Recorder` (its ``_mine``,
            ``record_attention``, ``record_probabilities``, ``dtype`` and ``_check``).
        idx: the layer's index.
        layer: the layer module.
        la: the layer's description (its attention branch the ``mamba2`` mixer).

    Returns:
        The hook handles.
    """
    mixer_spec = la.layer.attention
    module = get_path(layer, mixer_spec.module)
    got: Dict[str, Any] = {}

    def keep_mask(mod, args, kwargs):
        if recorder._mine():
            mask = (kwargs or {}).get("attention_mask", args[2] if len(args) > 2 else None)
            got["mask"] = mask

    def keep_projection(mod, args, output):
        if recorder._mine():
            got["projection"] = _first(output).detach()

    def keep_norm_input(mod, args, kwargs):
        if recorder._mine():
            given = list(args) + [(kwargs or {}).get(k) for k in ("hidden_states", "gate") if k in (kwargs or {})]
            if len(given) >= 2:
                got["core"], got["gate"] = given[0].detach(), given[1].detach()

    keep_context = input_keeper(recorder._mine, got)

    def record(mod, args, output):
        if not recorder._mine():
            return
        projection, ctx, mask = got.pop("projection", None), got.pop("context", None), got.pop("mask", None)
        core, gate = got.pop("core", None), got.pop("gate", None)
        if projection is None or ctx is None or core is None:
            raise RuntimeError(f"layer {idx}: the {la.family} Mamba-2 mixer did not run its input projection, gated norm "
                               "and output projection as the description says (the torch path of transformers' mixer "
                               "is recorded; a fused kernel is not)")
        inner = int(mod.intermediate_size)
        b, t = projection.shape[:2]
        u = projection[..., inner:2 * inner]
        valid = mask.to(torch.bool) if isinstance(mask, Tensor) and mask.dim() == 2 else None
        probs = None
        biased = mod.conv1d.bias is not None  # the bias heads' context needs their mixing, recorded or not
        if recorder.record_probabilities or biased:
            probs = mamba2_mixing_from_projection(mod, projection, core, gate, valid, recorder.dtype)
            if biased:
                full = probs.context(mamba2_values_with_bias(mod, u.to(probs.dtype)))  # (B, T, 2 C)
                from_bias = full[..., inner:]
                rebuilt = full[..., :inner] + from_bias
            else:
                rebuilt = probs.context(u.to(probs.dtype))
            recorder._check(idx, MAMBA2_CHECK, ctx, rebuilt)
        values, context = u.transpose(1, 2).unsqueeze(-1), ctx.reshape(b, t, inner, 1)  # (B, C, T, 1), (B, T, C, 1)
        if biased:
            values, context = mamba2_bias_heads(mod, values, ctx, from_bias)
            probs = probs if recorder.record_probabilities else None
        recorder.record_attention(mod, probs, values, context)

    return [module.register_forward_pre_hook(keep_mask, with_kwargs=True),
            get_path(layer, mixer_spec.value.path).register_forward_hook(keep_projection),
            get_path(module, "norm").register_forward_pre_hook(keep_norm_input, with_kwargs=True),
            get_path(layer, mixer_spec.out).register_forward_pre_hook(keep_context),
            module.register_forward_hook(record)]
