r"""Capture of Qwen3-Next's and Qwen3.5's token mixers as attention with one head of size 1 per channel.

Two mixers that no softmax description expresses, recorded so that every layer kind decomposes
them unchanged (``docs/linear_mixers.md``, "Wiring"):

- the **Gated DeltaNet** (``Attention(mixer="gated_delta_net")``, transformers' ``*GatedDeltaNet``):
  its coefficients are taken from the real forward pass (the outputs of its input projections, the
  mask it applies, its gated norm's input and gate) and composed into the per-channel mixing tensor
  G[c, t, s] over the value channels u_s of its input projection
  (:func:`~captum_normattr.decompose.primitives.linear_mixers.gated_delta_net_mixing`:
  the delta rule, the causal convolution with its SiLU slope, the gated RMSNorm's scale), so that the
  output projection's input is sum_s G[c, t, s] u_{s,c}. Recorded as probabilities (B, C, T, T), kept
  factored (:class:`~captum_normattr.decompose.primitives.channel_mixing.ChannelMixing`: the per-head
  delta-rule mixing, the convolution, its slope and the norm's scale, never the dense tensor),
  values (B, C, T, 1) and context (B, T, C, 1) (:func:`gated_delta_net_hooks`);
- the **gated attention** (``Attention(output_gate=...)``, the full-attention layers): the attention
  output times sigmoid(g_t), the gate g_t read per head from the query projection's output
  ([query_h | gate_h]). Per channel, o_t[h, c] = sum_s p_h[t, s] sigmoid(g_t[h, c]) v_s[h, c], so the
  probabilities become (B, H Dh, T, S) with p[h Dh + c] = p_h * sigmoid(g[h, c]) (factored: p_h and the
  gate as the per-target scale), the values
  (B, H Dh, S, 1) and the context (the output projection's real input) (B, T, H Dh, 1)
  (:func:`gated_attention_hooks`).

Both functions take the :class:`~captum_normattr.models.capture.recorder.Recorder`, the layer index,
the layer module and the layer's description, and return the hook handles.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec
from captum_normattr.decompose.primitives.channel_mixing import ChannelMixing
from captum_normattr.decompose.primitives.linear_mixers import delta_rule_mixing, gated_rmsnorm_scale, silu_slope
from captum_normattr.models.adapters import get_path
from captum_normattr.models.capture.record import input_keeper

__all__ = ["delta_net_coefficients", "gated_attention_hooks", "gated_delta_net_hooks", "split_delta_projections"]

#: transformers' ``l2norm`` epsilon of the queries and keys inside the delta-rule kernels
_L2_EPS = 1e-6


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


def _sizes(mixer: nn.Module) -> Tuple[int, int, int, int]:
    return mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim


def split_delta_projections(mixer: nn.Module, layout: str, outputs: Dict[str, Tensor]) -> Tuple[Tensor, ...]:
    r"""(q, k, v, b, a) from the real outputs of a Gated DeltaNet's input projections.

    Args:
        mixer: the Gated DeltaNet module (its head counts and sizes).
        layout: ``"delta_grouped"`` (``outputs["qkv"]`` is Qwen3-Next's ``in_proj_qkvz``, per key head
            [q | k | v | z]; ``outputs["ba"]`` its ``in_proj_ba``, per key head [b | a]) or
            ``"delta_split"`` (``outputs["qkv"]`` is [q | k | v], ``outputs["b"]`` and ``outputs["a"]`` the
            separate projections, Qwen3.5).
        outputs: the projections' outputs, (B, T, width) each.

    Returns:
        q, k (B, T, H_k d_k), v (B, T, H_v d_v) (value heads in order), b, a (B, T, H_v).
    """
    hk, hv, dk, dv = _sizes(mixer)
    r = hv // hk
    qkv = outputs["qkv"]
    bsz, length = qkv.shape[:2]
    if layout == "delta_grouped":
        q, k, v, _ = qkv.reshape(bsz, length, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = outputs["ba"].reshape(bsz, length, hk, 2 * r).split([r, r], dim=-1)
        q, k, v, b, a = (t.reshape(bsz, length, -1) for t in (q, k, v, b, a))
        return q, k, v, b, a
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return q, k, v, outputs["b"], outputs["a"]


def delta_net_coefficients(mixer: nn.Module, q: Tensor, k: Tensor, v: Tensor, b: Tensor, a: Tensor
                           ) -> Dict[str, Tensor]:
    r"""The delta rule's inputs as the mixer's forward computes them from its projections' outputs.

    The causal depthwise convolution (``conv1d``, no bias) over [q | k | v], its SiLU, the L2 norms of
    the queries and keys (epsilon 1e-6, as transformers' kernels), beta = sigmoid(b) and the log-decay
    g = -exp(A_log) softplus(a + dt_bias), in the dtype of ``q``.

    Args:
        mixer: the Gated DeltaNet module (``conv1d``, ``A_log``, ``dt_bias``, sizes).
        q, k, v, b, a: from :func:`split_delta_projections`.

    Returns:
        The keyword arguments of
        :func:`~captum_normattr.decompose.primitives.linear_mixers.gated_delta_net_mixing` but the
        target scale: ``query``, ``key`` (B, T, H_k, d_k), ``beta``, ``log_decay`` (B, T, H_v),
        ``value_pre_activation`` (B, T, H_v d_v), ``conv_weight`` (H_v d_v, K).

    Raises:
        ValueError: the convolution has a bias (a no-token term per target, which no kind expresses).
    """
    hk, hv, dk, dv = _sizes(mixer)
    dtype = q.dtype
    if mixer.conv1d.bias is not None:
        raise ValueError(f"{type(mixer).__name__}'s convolution has a bias: it adds a no-token term per target that no "
                         "layer kind expresses yet")
    weight = mixer.conv1d.weight.detach().to(device=q.device, dtype=dtype)  # (conv_dim, 1, K)
    kernel = weight.shape[-1]
    mixed = torch.cat([q, k, v], dim=-1)
    length = mixed.shape[1]
    pre = F.conv1d(mixed.transpose(1, 2), weight, None, padding=kernel - 1, groups=mixed.shape[-1])[..., :length]
    pre = pre.transpose(1, 2)
    pq, pk, pv = pre.split([hk * dk, hk * dk, hv * dv], dim=-1)

    def unit(x: Tensor) -> Tensor:
        x = F.silu(x).reshape(*x.shape[:2], hk, dk)
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)

    a_log = mixer.A_log.detach().to(device=q.device, dtype=dtype)
    dt_bias = mixer.dt_bias.detach().to(device=q.device, dtype=dtype)
    return dict(query=unit(pq), key=unit(pk), beta=torch.sigmoid(b.to(dtype)),
                log_decay=-a_log.exp() * F.softplus(a.to(dtype) + dt_bias), value_pre_activation=pv,
                conv_weight=weight[2 * hk * dk:, 0, :])


def gated_delta_net_hooks(recorder: Any, idx: int, layer: nn.Module, la: ArchitectureSpec) -> List[Any]:
    r"""Hooks that record a Gated DeltaNet mixer as attention with one head of size 1 per value channel.

    The input projections' real outputs give q, k, v, b, a (:func:`split_delta_projections`; the mixer
    zeroes the input of padding tokens, its mask argument says which); the gated norm's real input
    and gate give the per-target scale; the output projection's input is the context. With
    ``recorder.record_probabilities`` the per-channel mixing tensor G is computed in the recorder's
    dtype and its columns of padding tokens zeroed (their values are zero in the model, not in the
    linear map of the layer input the methods propagate).

    Args:
        recorder: the :class:`~captum_normattr.models.capture.recorder.Recorder`.
        idx: the layer index.
        layer: the layer module.
        la: the layer's description (its attention branch is the ``gated_delta_net`` mixer).

    Returns:
        The hook handles.

    Raises:
        ValueError: the mixer module lacks a Gated DeltaNet's projections or sizes.
    """
    mixer_spec = la.layer.attention
    module = get_path(layer, mixer_spec.module)
    layout = mixer_spec.value.layout
    prefix = mixer_spec.module + "."
    names = {"qkv": mixer_spec.value.path}
    names.update({"ba": prefix + "in_proj_ba"} if layout == "delta_grouped" else
                 {"b": prefix + "in_proj_b", "a": prefix + "in_proj_a"})
    missing = [p for p in list(names.values()) + [prefix + "norm", prefix + "A_log", prefix + "dt_bias"]
               if not _has(layer, p)]
    if missing or not all(isinstance(getattr(module, n, None), int)
                          for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")):
        raise ValueError(f"the {la.family} gated_delta_net mixer {mixer_spec.module!r} ({type(module).__name__}) has no "
                         f"{missing or 'head sizes'}: it is not a transformers Gated DeltaNet")
    got: Dict[str, Any] = {}

    def keep_mask(mod, args, kwargs):
        if recorder._mine():
            got.clear()
            got["mask"] = (kwargs or {}).get("attention_mask")

    def keep(key: str):
        def hook(mod, args, output):
            if recorder._mine():
                got[key] = _first(output).detach()

        return hook

    def keep_norm(mod, args, output):
        if recorder._mine() and len(args) >= 2:
            got["core"], got["gate"] = args[0].detach(), args[1].detach()

    keep_context = input_keeper(recorder._mine, got)

    def record(mod, args, output):
        if not recorder._mine():
            return
        if any(key not in got for key in list(names) + ["core", "context"]):
            raise RuntimeError(f"layer {idx}: the {la.family} Gated DeltaNet did not run its projections, gated norm "
                               "and output projection as described; the description does not match the model")
        q, k, v, b, a = split_delta_projections(mod, layout, {key: got[key] for key in names})
        bsz, length, channels = v.shape
        mask = got.get("mask")
        valid = mask.to(torch.bool) if isinstance(mask, Tensor) and mask.dim() == 2 else None
        probs = None
        if recorder.record_probabilities:
            dt = recorder.dtype
            coef = delta_net_coefficients(mod, q.to(dt), k.to(dt), v.to(dt), b, a)
            scale = gated_rmsnorm_scale(got["core"].to(dt).reshape(bsz, length, channels),
                                        got["gate"].to(dt).reshape(bsz, length, channels),
                                        mod.norm.weight.detach().to(device=q.device, dtype=dt),
                                        float(mod.norm.variance_epsilon), mod.head_v_dim, norm_before_gate=True)
            mixing = delta_rule_mixing(coef["query"], coef["key"], coef["beta"], coef["log_decay"])  # (B, H, T, T)
            # padding sources: zero in the model, whatever the layer input's map gives
            source = None if valid is None else valid[..., None].to(dt).expand(bsz, length, channels)
            dv = mod.head_v_dim
            probs = ChannelMixing(mixing, [(h, h * dv, (h + 1) * dv) for h in range(channels // dv)],
                                  coef["conv_weight"], silu_slope(coef["value_pre_activation"]), scale, source)
        context = got["context"].reshape(bsz, length, channels, 1)
        got.clear()
        recorder.record_attention(mod, probs, v.transpose(1, 2).unsqueeze(-1), context)

    handles = [module.register_forward_pre_hook(keep_mask, with_kwargs=True)]
    handles += [get_path(layer, path).register_forward_hook(keep(key)) for key, path in names.items()]
    handles.append(get_path(layer, prefix + "norm").register_forward_hook(keep_norm))
    handles.append(get_path(layer, mixer_spec.out).register_forward_pre_hook(keep_context))
    handles.append(module.register_forward_hook(record))
    return handles


def gated_attention_hooks(recorder: Any, idx: int, layer: nn.Module, la: ArchitectureSpec) -> List[Any]:
    r"""Hooks that record a softmax attention with a per-channel output gate as one head of size 1 per channel.

    The query projection's real output gives the gate (per head [query_h | gate_h], the module's
    ``head_dim``); when the output projection is about to run, the recording attention's
    probabilities (B, H, T, S) and values (B, H, S, Dh) are replaced by p_h[t, s] sigmoid(g_t[h, c])
    (B, H Dh, T, S) and (B, H Dh, S, 1), and the context by the output projection's real input
    (B, T, H Dh, 1). Registered before the recorder's context check, which then compares the same memory.

    Args:
        recorder: the :class:`~captum_normattr.models.capture.recorder.Recorder`.
        idx: the layer index.
        layer: the layer module.
        la: the layer's description (its attention names the ``output_gate`` projection).

    Returns:
        The hook handles.
    """
    attention = la.layer.attention
    module = get_path(layer, attention.module)
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        raise ValueError(f"the {la.family} gated attention {type(module).__name__} has no head_dim")
    got: Dict[str, Tensor] = {}

    def keep_gate(mod, args, output):
        if recorder._mine():
            out = _first(output).detach()
            got["gate"] = out.reshape(*out.shape[:-1], -1, 2 * head_dim)[..., head_dim:]  # (B, T, H, Dh)

    def regate(mod, args):
        if not recorder._mine() or not args or not isinstance(args[0], Tensor):
            return
        rec = recorder.records.get(idx, {})
        gate, values = got.pop("gate", None), rec.get("values")
        if gate is None or values is None or values.dim() != 4 or values.shape[-1] != head_dim:
            raise RuntimeError(f"layer {idx}: the {la.family} gated attention did not run its query projection "
                               f"{attention.output_gate} and its attention as described")
        bsz, heads, length, _ = values.shape
        dt = recorder.dtype
        gate = torch.sigmoid(gate.to(dt)).reshape(bsz, length, heads * head_dim)  # (B, T, H Dh), channel h Dh + c
        probs = rec.get("probs") if recorder.record_probabilities else None
        if probs is not None:  # p_h[t, s] sigmoid(g_t[h, c]), kept factored (decompose.primitives.channel_mixing)
            probs = ChannelMixing(probs.to(dt), [(h, h * head_dim, (h + 1) * head_dim) for h in range(heads)],
                                  gate.new_ones(heads * head_dim, 1), None, gate, None)
        per_channel = values.permute(0, 1, 3, 2).reshape(bsz, heads * head_dim, length, 1)
        context = args[0].detach().reshape(*args[0].shape[:2], heads * head_dim, 1)
        recorder.record_attention(module, probs, per_channel, context)

    return [get_path(layer, attention.output_gate).register_forward_hook(keep_gate),
            get_path(layer, attention.out).register_forward_pre_hook(regate)]


def _has(module: nn.Module, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True
