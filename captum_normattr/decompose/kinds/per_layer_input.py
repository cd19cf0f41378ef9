r"""Gemma 4 (text) layers: the exact token decomposition of every mechanism (docs/frontier.md, "Gemma 4").

Gemma 4's text layer (``Gemma4TextDecoderLayer``) is a sandwich layer with gains ``w`` (not
``1 + w``) and three additions. With x the layer input, e_t the per-layer input of token t,
c the ``layer_scalar`` and every N an RMSNorm ``w * u / rms(u)``:

    h = x + N_pa(Attn(N_in(x)))                   Attn with v_norm: v_{j,h} = (N_in(x)_j W_V)_h / s_{j,h}
    z = h + N_pf(FF(N_pre(h)))                    FF(u) = (act(u W_g) * (u W_u)) W_d
    z = h + N_pf(N_pf1(FF(N_pre(h))) + N_pf2(Experts(N_pre2(h))))   (enable_moe_block)
    y = c (z + N_ple((act(z W_gate) * e_t) W_proj))

Every nonlinear quantity is frozen at its value in the real forward pass, which makes the layer
linear in the parts of x:

* each norm's per-token scale 1 / rms(u_t) of its real input (as in every kind);
* the attention probabilities (recorded by an eager attention whose softmax keeps the float64 dtype);
* the value norm's per-(source, head) scale 1 / s_{j,h}, s_{j,h} = rms((N_in(x)_j W_V)_h) (no
  gain): v_{j<-k,h} = (N_in(x)_{j<-k} W_V)_h / s_{j,h}, like a norm's denominator;
* the dense FF by DecompX's gated rule (the package's, as for every gated FF: integrated gradients
  along t (a, b), a = u W_g, b = u W_u, part k = a_k b I1(a) + b_k I2(a); :func:`gated_parts`);
* with ``enable_moe_block``, the routing (chosen experts and weights, computed from h), each chosen
  expert decomposed by the same rule with its routing weight as the frozen factor of its up
  projection, the experts' norms at their real inputs;
* the per-layer-input gate act(z_t W_gate): held at its real value, the branch is linear in the
  other factor e_t, which is a function of token t's own id and embedding only (never another
  position). The whole branch output N_ple(...)_t is therefore token t's own part (k = t); it
  adds no no-token term.

The layer scalar multiplies every part. Shared keys and values (``num_kv_shared_layers``): a
layer that reuses the values of an earlier layer reuses that earlier layer's value PARTS (kept
per attention type while the decomposition runs forward), so the step stays exact; keys as
values (``attention_k_eq_v``): the value parts are ``k_proj``'s parts (before the key norm and
the rotary embedding), then the value-norm scale. Gemma 4 has no biases
(``attention_bias=False``; none in the FF or the per-layer branch), so the parts sum to the real
tensors with no bias part: sum_k y_{t<-k} = y_t.

:func:`layer_step` is one layer's step (every real intermediate tensor rebuilt in the parts'
dtype from the layer's real input and attention output, the weights cast to it). The attribution
classes read Gemma 4 through it: its description (``gemma4_text``,
:mod:`captum_normattr.arch.families.gemma4`) has the layer kind
:mod:`~captum_normattr.decompose.kinds.sandwich_per_layer_input`, whose DecompX step is
:func:`layer_step` on the recorded layer (:mod:`captum_normattr.models.capture.per_layer_input`
records what it reads beyond a sandwich layer). Standalone, with its own recording,
:func:`gemma4_token_parts` runs the decomposition forward through a whole ``Gemma4TextModel`` or
``Gemma4ForCausalLM`` (DecompX's propagation, with the vector parts), and
:func:`gemma4_logit_scores` projects the last layer's parts through the frozen final norm onto a
target logit; ``DecompXAttribution`` gives the same scores (tests/arch/test_gemma4_classes.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES, gate_integrals

__all__ = [
    "SharedValueParts",
    "frozen_rms_norm",
    "gated_parts",
    "gemma4_logit_scores",
    "gemma4_token_parts",
    "layer_step",
    "moe_block_parts",
    "per_layer_input_branch",
    "rms_norm",
    "store_value_parts",
    "value_norm_scale",
]


def _eps(norm: nn.Module) -> float:
    r"""A norm module's epsilon (Gemma4RMSNorm's ``variance_epsilon``, ``torch.nn.RMSNorm``'s ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return float(eps if eps is not None else torch.finfo(torch.float32).eps)


def _gain(norm: nn.Module, like: Tensor) -> Optional[Tensor]:
    r"""A norm module's gain w in ``like``'s dtype and device (None: a norm without scale, as ``v_norm``)."""
    weight = getattr(norm, "weight", None) if getattr(norm, "with_scale", True) else None
    return None if weight is None else weight.detach().to(device=like.device, dtype=like.dtype)


def _w(linear: nn.Module, like: Tensor) -> Tensor:
    r"""A linear module's weight (out, in) in ``like``'s dtype and device."""
    return linear.weight.detach().to(device=like.device, dtype=like.dtype)


def _rms_inverse(real: Tensor, eps: float) -> Tensor:
    return torch.pow(real.pow(2).mean(-1) + eps, -0.5)


def rms_norm(real: Tensor, norm: nn.Module) -> Tensor:
    r"""A Gemma 4 RMSNorm ``w * u / rms(u)`` of a real tensor, computed in ``real``'s dtype (the module computes in float32)."""
    out = real * _rms_inverse(real, _eps(norm))[..., None]
    gain = _gain(norm, real)
    return out if gain is None else out * gain


def frozen_rms_norm(parts: Tensor, real: Tensor, norm: nn.Module) -> Tensor:
    r"""A Gemma 4 RMSNorm applied to parts at its real per-token scale.

    Args:
        parts: (B, T, K, D) parts of the norm's input; real: (B, T, D) its real input.
        norm: the ``Gemma4RMSNorm`` (gain ``w`` where it has one).

    Returns:
        (B, T, K, D) parts of the norm's output (they sum to ``norm(real)`` where ``parts`` sum to ``real``).
    """
    out = parts * _rms_inverse(real, _eps(norm)).to(parts.dtype)[:, :, None, None]
    gain = _gain(norm, parts)
    return out if gain is None else out * gain


def value_norm_scale(raw_values: Tensor, norm: nn.Module) -> Tensor:
    r"""(B, T, H_kv) the value norm's frozen scale 1 / s_{j,h} at the real raw values (B, T, H_kv, Dh)."""
    return _rms_inverse(raw_values, _eps(norm))


def per_layer_input_branch(layer: nn.Module, z: Tensor, per_layer_input: Tensor) -> Tensor:
    r"""The real per-layer-input branch N_ple((act(z W_gate) * e_t) W_proj), (B, T, D), written out.

    Args:
        layer: a ``Gemma4TextDecoderLayer`` with ``hidden_size_per_layer_input > 0``.
        z: (B, T, D) the stream after the feed-forward branch; per_layer_input: (B, T, P) e_t.
    """
    gate = layer.act_fn(z @ _w(layer.per_layer_input_gate, z).T)
    projected = (gate * per_layer_input.to(z.dtype)) @ _w(layer.per_layer_projection, z).T
    return rms_norm(projected, layer.post_per_layer_input_norm)


def gated_parts(u_parts: Tensor, u: Tensor, w_gate: Tensor, w_up: Tensor, act, nodes: int = DEFAULT_NODES,
                coefs: Optional[Dict[str, Tensor]] = None, scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    r"""The gated hidden neurons g(a) b, a = u W_gate, b = r u W_up, and their parts by the package's gated rule.

    DecompX's rule for a gated feed-forward (:func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`):
    integrated gradients along t (a, b), part k = a_k b I1(a) + b_k I2(a) with
    I1 = int_0^1 t g'(t a) dt, I2 = int_0^1 g(t a) dt (:func:`~captum_normattr.decompose.primitives.gated_feed_forward.gate_integrals`);
    r is a frozen per-neuron factor (an expert's routing weight), 1 if None.

    Args:
        u_parts: (..., K, D) parts of the input; u: (..., D) the real input.
        w_gate, w_up: (..., D, F) right-multiplied weights (broadcast against ``u``).
        act: g; nodes: quadrature nodes.
        coefs: ``{"gate": b I1, "up": I2}`` (..., F) already computed at the real input (DecompX's), or None.
        scale: r (..., F), or None.

    Returns:
        (hidden parts (..., K, F), real hidden (..., F)).
    """
    a = (u.unsqueeze(-2) @ w_gate).squeeze(-2)
    b = (u.unsqueeze(-2) @ w_up).squeeze(-2)
    if scale is not None:
        b = b * scale
    if coefs is None:
        i1, i2 = gate_integrals(a, act, nodes)
        coefs = {"gate": b * i1, "up": i2 if scale is None else i2 * scale}
    parts = (u_parts @ w_gate) * coefs["gate"].unsqueeze(-2) + (u_parts @ w_up) * coefs["up"].unsqueeze(-2)
    return parts, act(a) * b


def _refuse(config) -> None:
    if getattr(config, "attention_bias", False):
        raise UnsupportedModelError(
            "Gemma 4 with attention_bias=True is not decomposed yet (the post-attention norm makes the output bias "
            "a per-token bias); see docs/frontier.md, \"Gemma 4\"")


#: the attention implementation :func:`gemma4_token_parts` switches a model to for one forward pass
_ATTENTION_NAME = "captum_normattr_gemma4_probs"


def _probability_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    r"""Eager attention whose softmax runs in the query's dtype (float64 stays float64); returns the probabilities.

    A fully masked row (a left-padding query) gets uniform probabilities instead of the NaN of a
    float32 softmax of a float64 mask minimum; only padding positions read it.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    probs = probs.to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(_ATTENTION_NAME, _probability_attention)
    AttentionMaskInterface.register(_ATTENTION_NAME, eager_mask)


@contextmanager
def _recording(base: nn.Module):
    r"""The probability attention and hooks recording each layer's input, per-layer input, attention output and probabilities.

    The model's attention implementation and its hooks are restored on exit, also after an error.
    """
    _register()
    config = base.config
    saved = config._attn_implementation
    records: List[Dict[str, Tensor]] = [dict() for _ in base.layers]
    handles = []

    def layer_hook(i):
        def hook(module, args, kwargs):
            records[i]["x"] = args[0] if args else kwargs["hidden_states"]
            records[i]["e"] = args[1] if len(args) > 1 else kwargs.get("per_layer_input")
        return hook

    def attention_hook(i):
        def hook(module, args, output):
            records[i]["attn"], records[i]["probs"] = output[0], output[1]
        return hook

    def output_hook(i):
        def hook(module, args, output):
            records[i]["y"] = output[0] if isinstance(output, tuple) else output
        return hook

    def router_hook(i):
        def hook(module, args, output):
            records[i]["route_weights"], records[i]["route_index"] = output[1], output[2]
        return hook

    try:
        config._attn_implementation = _ATTENTION_NAME
        for i, layer in enumerate(base.layers):
            if getattr(layer, "enable_moe_block", False):
                handles.append(layer.router.register_forward_hook(router_hook(i)))
            handles.append(layer.register_forward_pre_hook(layer_hook(i), with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(attention_hook(i)))
            handles.append(layer.register_forward_hook(output_hook(i)))
        yield records
    finally:
        for h in handles:
            h.remove()
        config._attn_implementation = saved


def _attention_parts(layer, n1_parts: Tensor, probs: Tensor, values: Tensor) -> Tensor:
    r"""(B, T, K, D) the attention output's parts: sum_h (sum_j alpha^h_ij v^h_{j<-k}) W_O^h."""
    b, t, k, _ = n1_parts.shape
    heads = probs.shape[1]
    groups = heads // values.shape[3]
    v = values.repeat_interleave(groups, dim=3)  # (B, T, K, H, Dh)
    context = torch.einsum("bhij,bjkhd->bikhd", probs.to(v.dtype), v).reshape(b, t, k, -1)
    return context @ _w(layer.self_attn.o_proj, context).T


class SharedValueParts:
    r"""The value parts that the layers storing their keys and values leave for the layers that reuse them.

    ``num_kv_shared_layers``: a reusing layer's values are those of the last storing layer of its
    attention type, a function of THAT layer's input; their parts are kept here per attention
    type while a decomposition runs forward (one store per forward pass). Not a dict, so that it
    travels as one object inside a layer's record.
    """

    def __init__(self) -> None:
        self.parts: Dict[str, Tensor] = {}


def _value_parts(layer, n1_parts: Tensor, n1: Tensor, shared: SharedValueParts) -> Tensor:
    r"""(B, T, K, H_kv, Dh) this layer's value parts: its own (v_norm's scale frozen) or the stored ones it reuses."""
    attn = layer.self_attn
    b, t, k, _ = n1_parts.shape
    if attn.is_kv_shared_layer:
        values = shared.parts.get(attn.layer_type)
        if values is None or values.shape[:3] != (b, t, k):
            raise UnsupportedModelError(f"layer {layer.layer_idx} reuses the values of an earlier "
                                        f"{attn.layer_type} layer, and none stored them in this forward pass")
        return values
    proj = attn.v_proj if attn.v_proj is not None else attn.k_proj  # keys as values (attention_k_eq_v)
    w = _w(proj, n1)
    raw = (n1 @ w.T).view(b, t, -1, attn.head_dim)
    scale = value_norm_scale(raw, attn.v_norm)  # (B, T, H_kv)
    values = (n1_parts @ w.T).view(b, t, k, -1, attn.head_dim) * scale[:, :, None, :, None]
    if attn.store_full_length_kv:
        shared.parts[attn.layer_type] = values
    return values


def store_value_parts(source: nn.Module, parts: Tensor, real: Tensor, shared: SharedValueParts) -> Tensor:
    r"""The value parts of a layer that stores its keys and values, left in ``shared`` for the layers reusing them.

    Args:
        source: the storing ``Gemma4TextDecoderLayer``; parts: (B, T, K, D) parts of its input x; real: (B, T, D) x.
        shared: where they are stored (per attention type).

    Returns:
        (B, T, K, H_kv, Dh) the value parts (the input norm and the value norm frozen at their real scales).
    """
    real = real.to(parts.dtype)
    return _value_parts(source, frozen_rms_norm(parts, real, source.input_layernorm),
                        rms_norm(real, source.input_layernorm), shared)


def layer_step(layer: nn.Module, parts: Tensor, rec: Dict[str, Tensor], shared: SharedValueParts,
               nodes: int = DEFAULT_NODES, coefs: Optional[Dict[str, Tensor]] = None,
               own_branch: bool = True) -> Tuple[Tensor, Tensor]:
    r"""One Gemma 4 layer's frozen step: parts of x -> parts of y, and the real y rebuilt (see the module docstring).

    Every real intermediate tensor is rebuilt in ``parts``' dtype from the recorded real input x and
    attention output a (the norms at their real scales, the gates at their real pre-activations); the
    weights are read from ``layer`` and cast to that dtype.

    Args:
        layer: the ``Gemma4TextDecoderLayer``.
        parts: (B, T, K, D) parts of the layer input x.
        rec: the layer's real tensors: ``"x"`` (B, T, D), ``"probs"`` (B, H, T, T), ``"attn"`` the attention
            module's output a (B, T, D), ``"e"`` the per-layer input (B, T, P) (with
            ``hidden_size_per_layer_input``), ``"route_weights"`` and ``"route_index"`` (B T, top-k) (with
            ``enable_moe_block``).
        shared: the forward pass's :class:`SharedValueParts` (written by storing layers, read by reusing ones).
        nodes: Gauss-Legendre nodes of the gated feed-forward rule (:func:`gated_parts`).
        coefs: the dense feed-forward's coefficients at its real input (``"gate"``, ``"up"``), or None.
        own_branch: add the per-layer-input branch to each token's own part (False: leave it out of the parts,
            DecompX's adjoint gives it to the tokens itself; the real y keeps it).

    Returns:
        (parts of y (B, T, K, D), the real y rebuilt (B, T, D)).
    """
    dtype = parts.dtype
    x, probs, a = rec["x"].to(dtype), rec["probs"], rec["attn"].to(dtype)
    b, t, k, d = parts.shape
    n1 = rms_norm(x, layer.input_layernorm)
    n1_parts = frozen_rms_norm(parts, x, layer.input_layernorm)
    values = _value_parts(layer, n1_parts, n1, shared)
    h_parts = parts + frozen_rms_norm(_attention_parts(layer, n1_parts, probs, values), a,
                                      layer.post_attention_layernorm)
    h = x + rms_norm(a, layer.post_attention_layernorm)
    n2 = rms_norm(h, layer.pre_feedforward_layernorm)
    n2_parts = frozen_rms_norm(h_parts, h, layer.pre_feedforward_layernorm)
    mlp = layer.mlp
    hidden_parts, hidden = gated_parts(n2_parts, n2, _w(mlp.gate_proj, n2).T, _w(mlp.up_proj, n2).T, mlp.act_fn,
                                       nodes, coefs)
    w_down = _w(mlp.down_proj, n2).T
    f_parts, f = hidden_parts @ w_down, hidden @ w_down
    if getattr(layer, "enable_moe_block", False):
        f_parts, f = moe_block_parts(layer, h_parts, h, f_parts, f, rec, nodes)
    z_parts = h_parts + frozen_rms_norm(f_parts, f, layer.post_feedforward_layernorm)
    z = h + rms_norm(f, layer.post_feedforward_layernorm)
    if layer.hidden_size_per_layer_input:
        if own_branch and k != t:
            raise ValueError(f"the per-layer-input branch goes to each token's own part: the parts are one per "
                             f"token (K = T = {t}), got K = {k}")
        branch = per_layer_input_branch(layer, z, rec["e"])  # token t's own part
        if own_branch:
            idx = torch.arange(t, device=parts.device)
            z_parts = z_parts.clone()
            z_parts[:, idx, idx, :] += branch
        z = z + branch
    c = layer.layer_scalar.detach().to(device=parts.device, dtype=dtype)
    return z_parts * c, z * c


def moe_block_parts(layer, h_parts: Tensor, h: Tensor, f_parts: Tensor, f: Tensor, rec: Dict[str, Tensor],
                  nodes: int) -> Tuple[Tensor, Tensor]:
    r"""The expert block beside the dense MLP: parts and real tensor of N_pf1(FF(u)) + N_pf2(Experts(N_pre2(h))).

    Routing (the chosen experts and their weights, computed from h) is frozen at the recorded
    values; each chosen expert is a gated FF decomposed by the gated rule with its routing
    weight r as the frozen factor of its up projection (:func:`gated_parts`; the package's rule
    for experts, :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`).
    """
    b, t, k, d = h_parts.shape
    experts = layer.experts
    u = rms_norm(h, layer.pre_feedforward_layernorm_2).reshape(b * t, d)
    u_parts = frozen_rms_norm(h_parts, h, layer.pre_feedforward_layernorm_2).reshape(b * t, 1, k, d)
    index, weights = rec["route_index"].reshape(b * t, -1), rec["route_weights"].reshape(b * t, -1).to(h.dtype)
    gate_up = experts.gate_up_proj.detach().to(device=h.device, dtype=h.dtype)[index]  # (B T, top-k, 2 I, D)
    gate_w, up_w = gate_up.chunk(2, dim=-2)  # (B T, top-k, I, D) each
    hidden_parts, hidden = gated_parts(u_parts, u[:, None, :].expand(-1, index.shape[1], -1),
                                       gate_w.transpose(-1, -2), up_w.transpose(-1, -2), experts.act_fn, nodes,
                                       scale=weights[..., None])  # (B T, top-k, K, I), (B T, top-k, I)
    down = experts.down_proj.detach().to(device=h.device, dtype=h.dtype)[index]  # (B T, top-k, D, I)
    e = torch.einsum("nsdi,nsi->nd", down, hidden).reshape(b, t, d)
    e_parts = torch.einsum("nsdi,nski->nkd", down, hidden_parts).reshape(b, t, k, d)
    parts = (frozen_rms_norm(f_parts, f, layer.post_feedforward_layernorm_1)
             + frozen_rms_norm(e_parts, e, layer.post_feedforward_layernorm_2))
    return parts, rms_norm(f, layer.post_feedforward_layernorm_1) + rms_norm(e, layer.post_feedforward_layernorm_2)


def _positions(mask: Tensor) -> Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def gemma4_token_parts(model: nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                       nodes: int = DEFAULT_NODES) -> Tuple[Tensor, Tensor, float]:
    r"""Per-token parts of the last layer's output of a Gemma 4 text model (the step of the module docstring).

    Args:
        model: ``Gemma4ForCausalLM`` or ``Gemma4TextModel`` (float64 for exactness checks).
        input_ids: (B, T) token ids; attention_mask: (B, T) 1 for real tokens (left padding), or None.
        nodes: Gauss-Legendre nodes of the gated feed-forward rule (:func:`gated_parts`).

    Returns:
        (parts (B, T, K, D) with parts[b, t, k] the part of token k in position t's last hidden state,
        the real last hidden state (B, T, D) before the final norm, the largest relative difference
        between the rebuilt layer outputs and the model's own).

    Raises:
        UnsupportedModelError: for ``attention_bias`` (see :func:`_refuse`).

    Examples::

        >>> parts, real, err = gemma4_token_parts(model, ids)
        >>> torch.testing.assert_close(parts.sum(2), real)
    """
    base = model.model if hasattr(model, "lm_head") else model
    _refuse(base.config)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    with torch.no_grad(), _recording(base) as records:
        base(input_ids=input_ids, attention_mask=mask, position_ids=_positions(mask))
        x = records[0]["x"]
        b, t, d = x.shape
        idx = torch.arange(t, device=x.device)
        parts = x.new_zeros(b, t, t, d)
        parts[:, idx, idx, :] = x  # the embedding of token k is its own part
        shared = SharedValueParts()
        worst = 0.0
        for layer, rec in zip(base.layers, records):
            parts, rebuilt = layer_step(layer, parts, rec, shared, nodes)
            y = rec["y"]
            worst = max(worst, float((rebuilt - y).abs().max() / y.abs().max()))
            real = y
    valid = mask.bool()
    parts = parts * (valid[:, None, :, None] & valid[:, :, None, None]).to(parts.dtype)
    return parts, real, worst


def gemma4_logit_scores(model: nn.Module, input_ids: Tensor, target: int, attention_mask: Optional[Tensor] = None,
                        nodes: int = DEFAULT_NODES) -> Tuple[Tensor, Tensor]:
    r"""Token scores of the last position's logit of ``target``, and that logit (the model's own, before any soft-cap).

    score_k = (w * final_{last<-k} / rms(final_last)) . W_lm[target]; sum_k score_k = the logit (no bias, no
    no-token term).

    Args:
        model: ``Gemma4ForCausalLM``; input_ids, attention_mask, nodes: as in :func:`gemma4_token_parts`.
        target: the vocabulary index.

    Returns:
        (scores (B, T), logits (B,)) where the logit is lm_head(norm(h)) of the last position.
    """
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise UnsupportedModelError("final_logit_softcapping is nonlinear: decompose a model built without it "
                                    "(the scores then sum to the logit before the cap)")
    parts, real, _ = gemma4_token_parts(model, input_ids, attention_mask, nodes)
    norm = model.model.norm
    with torch.no_grad():
        last_parts = frozen_rms_norm(parts[:, -1:], real[:, -1:], norm)[:, 0]  # (B, K, D)
        logits = model.lm_head(norm(real[:, -1]))[:, target]
        return last_parts @ model.lm_head.weight[target], logits
