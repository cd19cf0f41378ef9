r"""Mixtures of experts: the routing of the real forward pass, recorded, and the experts read as one gated FF.

A sparse feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE) computes, per token i,

    FF(u_i) = sum_{e in top_k(i)} r_ie FF_e(u_i) [+ sigmoid(u_i w_s) FF_s(u_i)],
    FF_e(u) = (g(u W_gate^e) * (u W_up^e)) W_down^e,

with the experts top_k(i) and the routing weights r_ie chosen by the router. The capture
records the routing the experts module was really called with (its arguments ``top_k_index``
and ``top_k_weights``, so a hook or a patched router is seen as it acted) and the shared
expert's gate logit; nothing of the router is recomputed. With the routing frozen, the block
is one gated FF of width E F_e [+ F_s]: the experts' hidden neurons side by side, each
neuron's up pre-activation times the token's weight of its expert (0 for the experts the
token did not choose, the sigmoid gate for the shared expert) — the per-token
:attr:`~captum_normattr.decompose.records.FFParams.hidden_scale`. Every FF decomposition of
a gated FF then applies unchanged: each chosen expert's parts are its dense gated parts
times its routing weight, the other experts' are exactly 0, and the parts sum to the real
FF output (``docs/architectures.md``, "Mixtures of experts"). The capture's FF guard rebuilds
the FF output at the last position from these weights and the recorded routing. Where the layer,
not the sparse block, adds the shared expert's output (Granite 4: ``Experts.shared_beside``), its
output is recorded too and the FF output is the sum.

The expert kernels (transformers' ``grouped_mm``) may refuse float64: nothing here needs the
model to run in float64 (the weights are read and cast to the compute dtype).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import FeedForward
from captum_normattr.decompose.primitives.gated_feed_forward import ClampedSwiGLUGate, ReLUGate
from captum_normattr.decompose.records import FFParams
from captum_normattr.models.adapters import linear_params
from captum_normattr.models.weights import module_tensor

__all__ = ["BIAS_NEURON_GATE", "EXPERT_KEYS", "clamped_swiglu_ff_params", "experts_ff_params", "experts_module",
           "input_scaled_ff_params", "register_expert_hooks", "routing_scale", "squared_relu_ff_params"]

#: The gate pre-activation of the constant neurons that carry GPT-OSS's per-expert output biases
#: (:func:`clamped_swiglu_ff_params`): any value with g(a) != 0 will do; 1 keeps g(a) of order 1.
BIAS_NEURON_GATE = 1.0

#: what the capture records of a sparse block: the routing the experts module was called with
#: and (with a gated shared expert) the shared gate's logit
EXPERT_KEYS: Tuple[str, ...] = ("expert_index", "expert_weights")


def _path(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def experts_module(layer: nn.Module, ff: FeedForward) -> Optional[nn.Module]:
    r"""The experts module of one layer, or None for a layer without one (a dense layer of the family)."""
    try:
        return _path(layer, ff.experts.module)
    except (AttributeError, IndexError):
        return None


def _routing_arguments(args: tuple, kwargs: Optional[dict]) -> Tuple[Tensor, Tensor, Tensor]:
    r"""(hidden (N, D), top_k_index (N, k), top_k_weights (N, k)) of a call ``experts(hidden, index, weights)``."""
    kwargs = kwargs or {}
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
    if len(values) < 3 or any(not isinstance(v, Tensor) for v in values):
        raise RuntimeError(
            "the experts module was not called as experts(hidden_states, top_k_index, top_k_weights): its routing "
            "cannot be recorded; describe the family's experts module (Experts.module) as the fused experts of "
            "transformers 5"
        )
    return values[0], values[1], values[2]


def register_expert_hooks(
    layer: nn.Module,
    ff: FeedForward,
    mine: Callable[[], bool],
    keep: Callable[[str, Tensor], None],
    check: Callable[[str, Tensor, Tensor], None],
    ff_input: Callable[[], Optional[Tensor]],
) -> List:
    r"""Hooks recording one layer's routing (and shared gate) for a recorder.

    Args:
        layer: the layer module.
        ff: its feed-forward description (kind ``experts``).
        mine: whether the current forward pass is the recorder's.
        keep: ``keep(key, tensor)`` records a tensor of this layer.
        check: ``check(name, real, assumed)`` keeps a consistency check of this layer.
        ff_input: the recorded FF input (the second norm's output) so far, or None.

    Returns:
        The hook handles (none for a layer without an experts module).
    """
    module = experts_module(layer, ff)
    if module is None:
        return []
    if ff.experts.kind == "input_scaled":
        return _input_scaled_hooks(layer, ff, module, mine, keep, check, ff_input)

    def pre_hook(mod, args, kwargs=None):  # kwargs=None: see the capture's compare_inputs
        if not mine():
            return
        hidden, index, weights = _routing_arguments(args, kwargs)
        keep("expert_index", index)
        keep("expert_weights", weights)
        u = ff_input()
        if u is not None and u.numel() == hidden.numel():
            check("experts input vs the second norm's output", hidden, u.reshape(hidden.shape))

    handles = [module.register_forward_pre_hook(pre_hook, with_kwargs=True)]
    if ff.experts.shared_gate is not None:

        def gate_hook(mod, args, output):
            if mine():
                keep("shared_gate_logit", output[0] if isinstance(output, (tuple, list)) else output)

        handles.append(_path(layer, ff.experts.shared_gate).register_forward_hook(gate_hook))
    if ff.experts.shared_beside is not None:  # the layer adds the shared expert's output itself (Granite 4)

        def shared_hook(mod, args, output):
            if not mine():
                return
            u = ff_input()
            if args and isinstance(args[0], Tensor) and u is not None and u.numel() == args[0].numel():
                check("shared expert input vs the second norm's output", args[0], u.reshape(args[0].shape))
            keep("shared_out", output[0] if isinstance(output, (tuple, list)) else output)

        handles.append(_path(layer, ff.experts.shared_beside).register_forward_hook(shared_hook))
    return handles


def _input_scaled_hooks(layer: nn.Module, ff: FeedForward, module: nn.Module, mine: Callable[[], bool],
                        keep: Callable[[str, Tensor], None], check: Callable[[str, Tensor, Tensor], None],
                        ff_input: Callable[[], Optional[Tensor]]) -> List:
    r"""Llama 4's routing: the router's (N, E) scores as it returned them, and a check that the experts module reads
    every token repeated per expert times its score (what :func:`input_scaled_ff_params` assumes)."""
    got: dict = {}

    def router_hook(mod, args, output):
        if mine():
            scores = output[0] if isinstance(output, (tuple, list)) else output
            got["scores"] = scores
            keep("expert_scores", scores)

    def experts_hook(mod, args):
        u, scores = ff_input(), got.pop("scores", None)
        if not mine() or not args or u is None or scores is None:
            return
        routed = args[0]
        u = u.reshape(-1, u.shape[-1])
        if routed.shape == (scores.shape[1] * u.shape[0], u.shape[1]):
            assumed = u.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1).to(u.dtype)
            check("experts input vs the second norm's output times the routing scores", routed, assumed)

    return [_path(layer, ff.experts.router).register_forward_hook(router_hook),
            module.register_forward_pre_hook(experts_hook)]


def input_scaled_ff_params(layer: nn.Module, ff: FeedForward, module: nn.Module, rec: dict, dtype: torch.dtype,
                           device: torch.device) -> FFParams:
    r"""Llama 4's experts (``Experts.kind="input_scaled"``) as one gated :class:`FFParams` with frozen scales.

    Expert e reads the routing-scaled input: FF_e(r_e u) = (g(r_e u W_gate^e) * (r_e u W_up^e)) W_down^e,
    with r_e the router's score of the token (0 for the experts not chosen). With the scores held
    fixed this is the gated form with the per-token factor r_e on the gate pre-activation
    (``gate_scale``) and on the up pre-activation (``hidden_scale``); the shared expert (an
    ungated gated FF on u) has both factors 1. Every gated-FF decomposition applies it: the
    gate's path integrals are taken at the real gate input r_e a (``docs/frontier.md``,
    "Input-scaled experts").

    Args:
        layer: the layer module.
        ff: its feed-forward description (kind ``experts``, ``Experts.kind="input_scaled"``).
        module: the experts module (``gate_up_proj`` (E, D, 2F) [gate | up] applied as u @ W^e,
            ``down_proj`` (E, F, D), as its ``is_transposed`` / ``is_concatenated`` flags say).
        rec: the layer's recorded tensors (``ln2_out`` and ``expert_scores`` (N, E)).
        dtype, device: of the returned tensors.

    Returns:
        :class:`FFParams` of width E F [+ F_s] with ``hidden_scale`` and ``gate_scale`` (B, T, F).
    """
    ex = ff.experts
    if "expert_scores" not in rec:
        raise RuntimeError(f"the forward pass recorded no routing scores from the router {ex.router!r}")
    cast = lambda x: None if x is None else x.detach().to(device=device, dtype=dtype)
    gate_up, down = cast(module_tensor(module, "gate_up_proj", ex.module)), cast(module_tensor(module, "down_proj", ex.module))
    if gate_up is None or down is None or gate_up.dim() != 3:
        raise ValueError(f"the experts module {ex.module} ({type(module).__name__}) has no 3-D gate_up_proj / down_proj")
    if not getattr(module, "is_transposed", True):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    e, d, two_f = gate_up.shape
    f = two_f // 2
    g_cols, u_cols = (slice(0, f), slice(f, two_f)) if getattr(module, "is_concatenated", True) else (
        slice(0, None, 2), slice(1, None, 2))
    flat = lambda w: w.permute(1, 0, 2).reshape(d, e * f)
    w_g, w_u, w_d = flat(gate_up[..., g_cols]), flat(gate_up[..., u_cols]), down.reshape(e * f, d)
    b, t = rec["ln2_out"].shape[:2]
    scores = cast(rec["expert_scores"]).reshape(b * t, e)
    scale = scores.repeat_interleave(f, dim=1)
    act = _path(layer, ff.act)
    if ex.shared is not None:
        sg, sgb, su, sub, sd, sdb = _gated_weights(layer, ex.shared)
        if any(x is not None for x in (sgb, sub, sdb)):
            raise NotImplementedError("a shared expert with biases is not decomposed")
        if not _same_activation(act, _path(layer, ex.shared.act)):
            raise NotImplementedError("the shared expert's activation differs from the experts': not decomposed")
        w_g, w_u = torch.cat([w_g, cast(sg)], 1), torch.cat([w_u, cast(su)], 1)
        w_d = torch.cat([w_d, cast(sd)], 0)
        scale = torch.cat([scale, scale.new_ones(b * t, sd.shape[0])], 1)
    scale = scale.reshape(b, t, -1)
    return FFParams(w_u, None, w_d, None, act, w_g, None, hidden_scale=scale, gate_scale=scale)


def _gated_weights(layer: nn.Module, ff: FeedForward) -> Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor], Tensor, Optional[Tensor]]:
    r"""(W_gate, b_gate, W_up, b_up, W_down, b_down), right-multiplied, of a gated FF description (plain modules)."""
    w_in, b_in = linear_params(_path(layer, ff.up))
    w_out, b_out = linear_params(_path(layer, ff.down))
    if ff.kind == "fused_gate_up":
        half = w_in.shape[1] // 2
        first, second = slice(0, half), slice(half, 2 * half)
        g, u = (first, second) if ff.gate_first else (second, first)
        pick = lambda t, cols: None if t is None else t[..., cols]
        return w_in[:, g], pick(b_in, g), w_in[:, u], pick(b_in, u), w_out, b_out
    w_g, b_g = linear_params(_path(layer, ff.gate))
    return w_g, b_g, w_in, b_in, w_out, b_out


def _same_activation(a: Callable, b: Callable) -> bool:
    probe = torch.linspace(-6.0, 6.0, 25, dtype=torch.float64)
    try:
        return bool(torch.allclose(a(probe), b(probe), rtol=1e-12, atol=0))
    except Exception:  # an activation that takes another dtype
        return bool(torch.allclose(a(probe.float()), b(probe.float()), rtol=1e-6, atol=0))


def _stacked_expert_weights(module: nn.Module, where: str) -> Tuple[Tensor, Tensor, Tensor, int]:
    r"""The experts of a fused experts module side by side, in ``nn.Linear`` layout (out, in).

    Returns:
        (gate (E F, D), up (E F, D), down (D, E F), E): row e F + f of ``gate`` / ``up`` is hidden
        neuron f of expert e, so that ``u @ gate.T`` is every expert's gate pre-activation.
        Copies of whole rows (the 3-D parameters are (E, 2F, D) and (E, D, F)), no strided transpose.
    """
    for flag, refused in (("has_bias", True), ("has_gate", False), ("has_post_expert_norm", True)):
        if bool(getattr(module, flag, not refused)) == refused:
            raise NotImplementedError(
                f"the experts module {where} ({type(module).__name__}) has {flag}={refused}: only gated experts "
                "without biases or post-expert norms are decomposed (GPT-OSS's biased, clamped experts are described "
                "with Experts(kind='clamped_swiglu'))"
            )
    gate_up = module_tensor(module, "gate_up_proj", where)
    down = module_tensor(module, "down_proj", where)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"the experts module {where} ({type(module).__name__}) has no 3-D gate_up_proj / down_proj parameters "
            "(transformers 5's fused experts)"
        )
    if getattr(module, "is_transposed", False):  # (E, D, 2F) and (E, F, D), applied as x @ W[e]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    e, two_f, d = gate_up.shape
    f = two_f // 2
    if getattr(module, "is_concatenated", True):  # rows [gate | up]
        gate, up = gate_up[:, :f], gate_up[:, f:]
    else:  # rows [g0, u0, g1, u1, ...]
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return gate.reshape(e * f, d), up.reshape(e * f, d), down.permute(1, 0, 2).reshape(d, e * f), e


def routing_scale(index: Tensor, weights: Tensor, num_experts: int) -> Tensor:
    r"""(N, E): token n's routing weight of expert e (0 where e is not among its chosen experts).

    Args:
        index: (N, k) long, the chosen experts (an index ``num_experts`` marks a slot to skip,
            as transformers' expert-parallel masking does).
        weights: (N, k) their routing weights.
        num_experts: E.
    """
    out = weights.new_zeros(index.shape[0], num_experts + 1)
    out.scatter_add_(1, index.long().clamp(0, num_experts), weights)
    return out[:, :num_experts]


def experts_ff_params(
    layer: nn.Module, ff: FeedForward, rec: dict, dtype: torch.dtype, device: torch.device
) -> FFParams:
    r"""One layer's sparse block as a gated :class:`FFParams` with its frozen per-token hidden scale.

    Args:
        layer: the layer module.
        ff: its feed-forward description (kind ``experts``).
        rec: the layer's recorded tensors (``ln2_out`` (B, T, D) and :data:`EXPERT_KEYS`, with
            ``shared_gate_logit`` for a gated shared expert).
        dtype, device: of the returned tensors.

    Returns:
        :class:`FFParams` of width E F_e [+ F_s]: W_gate, W_in (up) (D, F), W_out (F, D) the
        experts' (and the shared expert's) blocks side by side, ``hidden_scale`` (B, T, F).
        A layer without an experts module (a dense layer) gives its dense FF
        (``Experts.dense``), without a hidden scale.

    Raises:
        RuntimeError: the forward pass recorded no routing for a sparse layer.
        NotImplementedError: experts with biases, without a gate, or whose activation
            differs from the shared expert's.
    """
    ex = ff.experts
    cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)
    module = experts_module(layer, ff)
    if module is None:
        if ex.dense is None:
            raise ValueError(f"the layer has no experts module {ex.module!r} and the description names no dense FF")
        w_g, b_g, w_u, b_u, w_d, b_d = _gated_weights(layer, ex.dense)
        return FFParams(cast(w_u), cast(b_u), cast(w_d), cast(b_d), _path(layer, ex.dense.act), cast(w_g), cast(b_g))
    if ex.kind == "input_scaled":
        return input_scaled_ff_params(layer, ff, module, rec, dtype, device)
    missing = [k for k in EXPERT_KEYS + (("shared_gate_logit",) if ex.shared_gate else ()) if k not in rec]
    if missing:
        raise RuntimeError(f"the forward pass recorded no {missing} for the experts module {ex.module!r}")
    b, t = rec["ln2_out"].shape[:2]
    index, weights = rec["expert_index"], rec["expert_weights"]
    if index.shape[0] != b * t:
        raise RuntimeError(f"the experts module routed {index.shape[0]} tokens, not the batch's {b} x {t}")
    if ex.kind == "squared_relu":
        return squared_relu_ff_params(layer, ff, module, index.to(device), cast(weights), dtype, device, (b, t))
    if ex.kind == "clamped_swiglu":
        e = int(module_tensor(module, "gate_up_proj", ex.module).shape[0])
        return clamped_swiglu_ff_params(module, ex.module, cast(rec["ln2_out"]).reshape(b * t, -1),
                                        cast(routing_scale(index.to(device), cast(weights), e)), dtype, device, (b, t))
    gate, up, down, e = _stacked_expert_weights(module, ex.module)  # (E F, D), (E F, D), (D, E F)
    f = gate.shape[0] // e
    act = _path(layer, ff.act)
    scale = cast(routing_scale(index.to(device), cast(weights), e)).repeat_interleave(f, dim=1)  # (N, E F)
    if ex.shared is not None:
        sg, sgb, su, sub, sd, sdb = _gated_weights(layer, ex.shared)  # right-multiplied: (D, Fs), (Fs, D)
        if any(x is not None for x in (sgb, sub, sdb)):
            raise NotImplementedError("a shared expert with biases is not decomposed")
        if not _same_activation(act, _path(layer, ex.shared.act)):
            raise NotImplementedError("the shared expert's activation differs from the experts': not decomposed")
        fs = sd.shape[0]
        if ex.shared_gate is not None:  # sigmoid in the dtype the model computed it in, then cast (held fixed)
            gate_value = cast(torch.sigmoid(rec["shared_gate_logit"].detach())).reshape(b * t, 1)
        else:
            gate_value = scale.new_ones(b * t, 1)
        gate, up = torch.cat([cast(gate), cast(sg.T)], 0), torch.cat([cast(up), cast(su.T)], 0)
        down = torch.cat([cast(down), cast(sd.T)], 1)
        scale = torch.cat([scale, gate_value.expand(b * t, fs)], 1)
    w_g, w_u, w_d = cast(gate).T, cast(up).T, cast(down).T  # right-multiplied views: (D, F), (D, F), (F, D)
    return FFParams(w_u, None, w_d, None, act, w_g, None, hidden_scale=scale.reshape(b, t, -1))


def clamped_swiglu_ff_params(module: nn.Module, where: str, u: Tensor, routing: Tensor, dtype: torch.dtype,
                             device: torch.device, batch: Tuple[int, int]) -> FFParams:
    r"""GPT-OSS's experts (``Experts.kind="clamped_swiglu"``) as one gated :class:`FFParams` with a frozen hidden scale.

    Expert e's neuron f computes, for a token u routed to it with weight r_e,

        r_e (clamp(b, -L, L) + 1) g(a) W_down^e[f] (summed over f, plus r_e b_down^e),
        a = u W_gate^e[:, f] + b_gate^e[f],  b = u W_up^e[:, f] + b_up^e[f],
        g(a) = c sigmoid(alpha c), c = min(a, L)  (:class:`ClampedSwiGLUGate`).

    With the routing and the up half's clamp taken from the real forward pass this is the gated
    form g(a) * (b + 1) * s, b + 1 = u W_up + (b_up + 1) linear in u, and the frozen factor
    s = r_e (clamp(b) + 1) / (b + 1) (r_e where b is not clamped; where it is, s scales every
    part of b + 1 by the same recorded ratio, like a norm's recorded scale). The output biases
    r_e b_down^e vary with the token's routing, so each expert gets one constant neuron more
    (no weights; a = :data:`BIAS_NEURON_GATE`, b + 1 = 1, s = r_e / g(a), W_down row b_down^e):
    the FF's bias parts carry them, and the parts still sum to the real output.

    Args:
        module: the experts module (``gate_up_proj`` (E, D, 2F) applied as u @ W^e, columns
            [g0, u0, g1, u1, ...], as its ``is_transposed`` / ``is_concatenated`` flags say;
            ``gate_up_proj_bias`` (E, 2F); ``down_proj`` (E, F, D);
            ``down_proj_bias`` (E, D); ``limit``; ``alpha``).
        where: its path (for errors).
        u: (N, D) the tokens' FF inputs, in the compute dtype.
        routing: (N, E) the tokens' routing weight per expert (0 where not chosen).
        dtype, device: of the returned tensors.
        batch: (B, T), with N = B T.

    Returns:
        :class:`FFParams` of width E F + E, the hidden scale (B, T, E F + E).
    """
    cast = lambda x: None if x is None else x.detach().to(device=device, dtype=dtype)
    gate_up, gate_up_bias = cast(module_tensor(module, "gate_up_proj", where)), cast(module_tensor(module, "gate_up_proj_bias", where))
    down, down_bias = cast(module_tensor(module, "down_proj", where)), cast(module_tensor(module, "down_proj_bias", where))
    limit, alpha = getattr(module, "limit", None), getattr(module, "alpha", None)
    if gate_up is None or down is None or gate_up.dim() != 3 or limit is None or alpha is None:
        raise ValueError(f"the experts module {where} ({type(module).__name__}) is not GPT-OSS's clamped SwiGLU experts "
                         "(3-D gate_up_proj (E, D, 2F), down_proj (E, F, D), limit and alpha)")
    if not getattr(module, "is_transposed", True):  # (E, 2F, D) and (E, D, F): to the x @ W[e] layout
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    e, d, two_f = gate_up.shape
    f = two_f // 2
    # columns [g0, u0, g1, u1, ...] (GPT-OSS, is_concatenated=False) or [gate | up]
    g_cols, u_cols = (slice(0, f), slice(f, two_f)) if getattr(module, "is_concatenated", False) else (
        slice(0, None, 2), slice(1, None, 2))
    flat = lambda w: w.permute(1, 0, 2).reshape(d, e * f)  # (E, D, F) -> (D, E F), neuron e F + f
    w_g, w_u = flat(gate_up[..., g_cols]), flat(gate_up[..., u_cols])
    zeros = gate_up.new_zeros(e, two_f) if gate_up_bias is None else gate_up_bias
    b_g, b_u = zeros[:, g_cols].reshape(e * f), zeros[:, u_cols].reshape(e * f)
    up = torch.addmm(b_u, u, w_u)  # the real up pre-activations b (N, E F)
    ratio = torch.where(up.abs() > limit, (up.clamp(-limit, limit) + 1) / (up + 1), torch.ones_like(up))
    scale = routing.repeat_interleave(f, dim=1) * ratio
    act = ClampedSwiGLUGate(limit, alpha)
    w_d = down.reshape(e * f, d)
    if down_bias is not None:  # one constant neuron per expert carries r_e b_down^e
        g0 = act(torch.tensor(BIAS_NEURON_GATE, dtype=dtype, device=device))
        w_g, w_u = torch.cat([w_g, w_g.new_zeros(d, e)], 1), torch.cat([w_u, w_u.new_zeros(d, e)], 1)
        b_g = torch.cat([b_g, b_g.new_full((e,), BIAS_NEURON_GATE)])
        b_u = torch.cat([b_u, b_u.new_zeros(e)])
        w_d = torch.cat([w_d, down_bias], 0)
        scale = torch.cat([scale, routing / g0], 1)
    return FFParams(w_u, b_u + 1, w_d, None, act, w_g, b_g, hidden_scale=scale.reshape(*batch, -1))


def _squared_relu(x: Tensor) -> Tensor:
    return torch.relu(x) ** 2


def squared_relu_ff_params(layer: nn.Module, ff: FeedForward, module: nn.Module, index: Tensor, weights: Tensor,
                           dtype: torch.dtype, device: torch.device, batch: Tuple[int, int]) -> FFParams:
    r"""Nemotron-H's experts (``Experts.kind="squared_relu"``) as one gated :class:`FFParams` with a frozen hidden scale.

    Expert e's neuron f computes r_e relu(a)^2 W_down^e[f] with a = u W_up^e[:, f] (no gate, no bias). As
    relu(a)^2 = relu(a) * a, it is the gated form g(a) * b with W_gate = W_up (b = a) and g = ReLU
    (:class:`~captum_normattr.decompose.primitives.gated_feed_forward.ReLUGate`): integrated gradients along
    t (a, b) is then the straight path of the elementwise ReLU², the parts a_j relu(a) are its closed form's, and
    the gate integrals are exact (no quadrature error). The shared expert (a plain ReLU² MLP, its biases allowed)
    is the same form with the factor 1; the routing is the recorded one, held fixed. Latent projections around
    the routed experts (``Experts.latent``: z = u W_1 + b_1 into the experts' space, their sum s back as
    s W_2 + b_2) are linear: folded, W_up^e <- W_1 W_up^e with the bias b_1 W_up^e, W_down^e <- W_down^e W_2,
    and b_2 joins the output bias.

    Args:
        layer: the layer module.
        ff: its feed-forward description (kind ``experts``, ``Experts.kind="squared_relu"``).
        module: the experts module (``up_proj`` (E, F, D), ``down_proj`` (E, D, F), ``act_fn`` ReLU²).
        index, weights: (N, k) the recorded routing (the experts module's arguments), N = B T.
        dtype, device: of the returned tensors.
        batch: (B, T).

    Returns:
        :class:`FFParams` of width E F [+ F_s], W_gate = W_in, the hidden scale (B, T, E F [+ F_s]).

    Raises:
        NotImplementedError: an activation other than ReLU² (experts or shared expert), or experts with biases.
    """
    ex = ff.experts
    cast = lambda x: None if x is None else x.detach().to(device=device, dtype=dtype)
    up, down = cast(module_tensor(module, "up_proj", ex.module)), cast(module_tensor(module, "down_proj", ex.module))
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"the experts module {ex.module} ({type(module).__name__}) has no 3-D up_proj (E, F, D) / "
                         "down_proj (E, D, F) (Nemotron-H's non-gated experts)")
    if bool(getattr(module, "has_bias", False)) or bool(getattr(module, "is_transposed", False)):
        raise NotImplementedError(f"the experts module {ex.module} has biases or a transposed layout: not decomposed")
    if not _same_activation(_path(layer, ff.act), _squared_relu):
        raise NotImplementedError(f"the experts' activation {ff.act} is not ReLU²: squared_relu experts are read as "
                                  "relu(a) * a, which holds for ReLU² only")
    e, f, d = up.shape
    w_u, w_d = up.reshape(e * f, d).T, down.transpose(1, 2).reshape(e * f, d)  # (D, E F), (E F, D): neuron e F + f
    scale = routing_scale(index, weights, e).repeat_interleave(f, dim=1)  # (N, E F)
    b_u, b_d = None, None
    into, back = (_linear_or_none(layer, p) for p in (ex.latent or (None, None)))
    if into is not None:  # z = u W_1 + b_1: the experts' up pre-activation z W_up = u (W_1 W_up) + b_1 W_up
        w1, b1 = (cast(t) for t in into)
        b_u = None if b1 is None else b1 @ w_u
        w_u = w1 @ w_u
    if back is not None:  # (sum_e ...) W_2 + b_2
        w2, b2 = (cast(t) for t in back)
        w_d, b_d = w_d @ w2, b2
    if ex.shared is not None:
        if not _same_activation(_path(layer, ex.shared.act), _squared_relu):
            raise NotImplementedError("the shared expert's activation is not ReLU²: not decomposed")
        su, sub = linear_params(_path(layer, ex.shared.up))
        sd, sdb = linear_params(_path(layer, ex.shared.down))
        fs = su.shape[1]
        if sub is not None or b_u is not None:  # its up bias is in a = b: the gate's and the up's bias
            b_u = torch.cat([w_u.new_zeros(e * f) if b_u is None else b_u,
                             cast(sub) if sub is not None else w_u.new_zeros(su.shape[1])])
        if sdb is not None:
            b_d = cast(sdb) if b_d is None else b_d + cast(sdb)
        w_u, w_d = torch.cat([w_u, cast(su)], 1), torch.cat([w_d, cast(sd)], 0)
        scale = torch.cat([scale, scale.new_ones(scale.shape[0], fs)], 1)
    return FFParams(w_u, b_u, w_d, b_d, ReLUGate(), w_u, b_u, hidden_scale=scale.reshape(*batch, -1))


def _linear_or_none(layer: nn.Module, path: Optional[str]) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    r"""(W, b) right-multiplied of the linear module at ``path``; None for no path or an ``nn.Identity`` there."""
    if path is None:
        return None
    module = _path(layer, path)
    if isinstance(module, nn.Identity):
        return None
    return linear_params(module)
