r"""Sandwich layers with per-layer inputs (Gemma 4's text layer; docs/frontier.md, "Gemma 4").

With x the layer input, e_t the per-layer input of token t, c the layer scalar and every N an
RMSNorm (gain w):

    h = x + N_pa(Attn(N_in(x)))                      values normalised per head (v_norm), maybe shared
    z = h + N_pf(FF(N_pre(h)))                       (enable_moe_block: N_pf(N_pf1(FF) + N_pf2(Experts)))
    y = c (z + N_ple((act(z W_gate) * e_t) W_proj))

The attention block h is a sandwich layer's, recorded as one (the real probabilities, the values
the attention read, its post-norm's real scale): every map of the sandwich kind
(:mod:`captum_normattr.decompose.kinds.sandwich`) — the GlobEnc table, ALTI's map, the
completeness error — is the one of h, unchanged. What follows h is position-wise (the feed-forward
block, the experts, the per-layer-input branch, which reads token t's own stream and input, and
the scalar), as a feed-forward block is for those maps.

ALTI-Logit (:meth:`SandwichPerLayerInputKind.logit_form`): the scalars multiply the stream, so the
final norm's input is x_L = C_0 x_0 + sum_l (C_l A_l + C_{l+1} y_l - C_l h_l) with C_l the product
of the scalars of layers l..L-1 (C_L = 1): the attention update A_l counts C_l times, the rest of
layer l (the feed-forward block and the per-layer-input branch, one no-token update per position)
is C_{l+1} y_l - C_l h_l, and the embedding C_0 x_0. The sum telescopes to x_L exactly.

DecompX (:meth:`SandwichPerLayerInputKind.decompx_step`): the frozen step of
:func:`~captum_normattr.decompose.kinds.per_layer_input.layer_step` (the value norm's per-source
scale, the shared value parts, the experts, the branch to each token's own part, the scalar),
whose dense feed-forward takes DecompX's own coefficients. DecompX's adjoint
(:mod:`captum_normattr.decompose.methods.decompx.frozen_per_layer_input`): the same step applied to one
vector and transposed; a layer that reuses an earlier layer's values also hands the cotangent of that
layer's input on (:meth:`SandwichPerLayerInputKind.frozen_layer_source_vjp`), and the branch, token t's
own, adds <g_t, c B_t> to token t's score (:meth:`SandwichPerLayerInputKind.frozen_layer_own`).

FF component scopes (FFIntegratedDecomposition; :func:`per_layer_input_scope_maps`), each against the
model's real tensor, with every norm (N_pre, N_pf, and with experts N_pre2, N_pf1, N_pf2) frozen at
its real per-token scale and the feed-forward blocks decomposed by the gated rule of DecompX's step
(:func:`~captum_normattr.decompose.kinds.per_layer_input.gated_parts`, ``nodes`` Gauss-Legendre nodes):

    ATB_{i<-j}  = h_{i<-j} = [i = j] x_i + N_pa's parts of the attention output    (against h_i)
    LN2_{i<-j}  = N_pre(h)_{i<-j}                  the dense FF's input            (against N_pre(h_i))
    FF_{i<-j}   = N_pf(FF)_{i<-j}, with experts N_pf(N_pf1(FF) + N_pf2(Experts))_{i<-j}, the routing
                  frozen (the feed-forward branch as it joins the stream)        (against N_pf's output)
    RES2_{i<-j} = c (h_{i<-j} + FF_{i<-j} + [i = j] B_i)   the whole layer        (against y_i)

with B_i = N_ple((act(z_i W_gate) * e_i) W_proj) the real per-layer-input branch, token i's OWN part (its
gate frozen at its real value, e_i a function of token i alone; as in DecompX's step), and the layer
scalar c multiplying every part. RES2 is the whole layer (the default scope). There is no bias part
(Gemma 4 has no biases).

Routes (:mod:`captum_normattr.decompose.methods.routes`, docs/routes.md), every edge vector a real
tensor's additive piece:

- into m_{l,i} = h_i: the residual x_i and, per head h and source j, N_pa's frozen part
  gamma_pa * alpha^h_ij v^h_j W_O^h / r_pa,i (:meth:`SandwichPerLayerInputKind.route_form`, the
  sandwich kind's pre-LN form; v^h_j the values the attention read, normalised per head by v_norm);
- into x_{l+1,i} = y_i: c h_i (residual, from m_{l,i}), c N_pf(FF)_i (the feed-forward branch with its
  experts, from m_{l,i} through the FF node) and c B_i (the per-layer-input branch, from the leaf p_{l,i}:
  token i's own, as in DecompX's step; its gate reads z_i, but its content e_i is token i's alone);
- a layer that reuses an earlier layer's keys and values (``num_kv_shared_layers``) reads values computed
  from the input of the last storing layer l' of its attention type: its head edges come from x_{l',j}
  (:meth:`SandwichPerLayerInputKind.route_value_layer`), skipping the layers between.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.decompose.kinds import pre_ln as decoder
from captum_normattr.decompose.kinds.base import CaptureRecipe, FFOptions
from captum_normattr.decompose.kinds.per_layer_input import (
    moe_block_parts,
    frozen_rms_norm,
    gated_parts,
    layer_step,
    per_layer_input_branch,
    rms_norm,
)
from captum_normattr.decompose.kinds.sandwich import SandwichKind, pre_ln_form
from captum_normattr.decompose.methods.decompx.frozen_per_layer_input import (
    frozen_per_layer_input_layer,
    per_layer_input_layer_own,
    per_layer_input_layer_vjp,
)
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES
from captum_normattr.decompose.primitives.guards import relative_difference
from captum_normattr.decompose.records import LayerTensors

__all__ = ["PER_LAYER_INPUT_CAPTURE", "SandwichPerLayerInputKind", "per_layer_input_scope_maps"]

#: A sandwich layer's record (the branch post-norms' inputs and outputs); the feed-forward post-norm's
#: input is the dense FF's output only without experts (checked in the kind's joins).
PER_LAYER_INPUT_CAPTURE = CaptureRecipe(
    extra_keys=("attn_post_in", "attn_post_out", "ff_post_in", "ff_post_out"),
    identity_checks=decoder.PRE_LN_CAPTURE.identity_checks,
    post_norms=("attn_post", "ff_post"),
)


def _extra(layer: LayerTensors, name: str) -> Any:
    r"""What the capture put in the record's ``extras`` (:mod:`captum_normattr.models.capture.per_layer_input`): the
    layer ``module`` (its weights), the pass's ``shared_values``, the ``stream_scale`` C_l, and, where the layer has
    them, the ``per_layer_input`` e (B, T, P) and the expert block's ``route_weights`` and ``route_index``."""
    if name not in layer.extras:
        raise ValueError(f"layer {layer.index}: a per-layer-input layer's record carries {name!r} in its extras "
                         "(the capture of captum_normattr.models.capture.per_layer_input fills them)")
    return layer.extras[name]


def _step_record(layer: LayerTensors) -> Dict[str, Tensor]:
    r"""The real tensors :func:`~captum_normattr.decompose.kinds.per_layer_input.layer_step` reads, from the record."""
    rec = {"x": layer.hidden_in, "probs": layer.probs, "attn": layer.attn_post_in}
    for key, name in (("e", "per_layer_input"), ("route_weights", "route_weights"), ("route_index", "route_index")):
        if layer.extras.get(name) is not None:
            rec[key] = layer.extras[name]
    return rec


def _w(linear: torch.nn.Module, like: Tensor) -> Tensor:
    r"""A linear module's weight, right-multiplied (in, out), in ``like``'s dtype and device."""
    return linear.weight.detach().to(device=like.device, dtype=like.dtype).T


def per_layer_input_scope_maps(
    layer: LayerTensors, valid: Tensor, options: FFOptions
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Maps of the FF component scopes of a per-layer-input layer (``ATB``, ``LN2``, ``FF``, ``RES2``; module docstring).

    Built in chunks of query rows as the pre-LN scopes
    (:func:`~captum_normattr.decompose.kinds.pre_ln.pre_ln_component_scope_maps`): the attention block's
    parts are the sandwich kind's (:func:`~captum_normattr.decompose.kinds.sandwich.pre_ln_form`), the rest
    is written out from the layer module's weights and the recorded real tensors. ``options.method`` and
    ``steps`` do not apply (the feed-forward blocks are gated); ``nodes`` does.

    Args:
        layer: a per-layer-input layer's record; valid: (B, T) bool; options: the FF options.

    Returns:
        (maps scope -> (B, T, T), errors ``"ff"`` (max over real tokens of |FF parts - N_pf's real output|),
        ``"layer"`` (|RES2 parts - the real layer output|) and their ``"*_per_example"`` (B,)).
    """
    view = pre_ln_form(layer)
    module = _extra(layer, "module")
    causal = layer.causal
    h = layer.ln2_in
    outputs = {"ATB": h, "LN2": layer.ln2_out, "FF": layer.ff_post_out, "RES2": layer.layer_out}
    score = decoder.scope_scorer(options.contribution, outputs)
    b, t, _ = h.shape
    chunk = decoder.scope_chunk_rows(view, options.chunk_rows, options.memory_budget_mb, causal)
    maps = {s: h.new_zeros(b, t, t) for s in decoder.PRE_LN_SCOPES}
    ff_err, layer_err = h.new_zeros(b, t), h.new_zeros(b, t)
    c = module.layer_scalar.detach().to(device=h.device, dtype=h.dtype)
    branch = None
    if getattr(module, "hidden_size_per_layer_input", 0):  # token i's own part, from the real z_i and e_i
        branch = per_layer_input_branch(module, h + layer.ff_post_out, _extra(layer, "per_layer_input"))
    experts = bool(getattr(module, "enable_moe_block", False))
    if experts:
        top_k = _extra(layer, "route_index").reshape(b, t, -1).shape[-1]
        route_index = _extra(layer, "route_index").reshape(b, t, top_k)
        route_weights = _extra(layer, "route_weights").reshape(b, t, top_k)
    mlp = module.mlp
    w_gate, w_up, w_down = _w(mlp.gate_proj, h), _w(mlp.up_proj, h), _w(mlp.down_proj, h)
    nodes = options.nodes or DEFAULT_NODES

    for start in range(0, t, chunk):
        rows = slice(start, min(t, start + chunk))
        cols = rows.stop if causal else t  # causal: sources j > i have exactly zero parts
        hp = decoder.residual_parts(view, rows, cols)  # (B, R, C, D) h_{i<-j}
        h_rows = h[:, rows]
        maps["ATB"][:, rows, :cols] = score("ATB", hp, rows)
        u_parts = frozen_rms_norm(hp, h_rows, module.pre_feedforward_layernorm)
        maps["LN2"][:, rows, :cols] = score("LN2", u_parts, rows)
        hidden_parts, hidden = gated_parts(u_parts, rms_norm(h_rows, module.pre_feedforward_layernorm), w_gate, w_up,
                                           mlp.act_fn, nodes)
        del u_parts
        f_parts, f = hidden_parts @ w_down, hidden @ w_down
        del hidden_parts
        if experts:
            rec = {"route_index": route_index[:, rows], "route_weights": route_weights[:, rows]}
            f_parts, f = moe_block_parts(module, hp, h_rows, f_parts, f, rec, nodes)
        ffp = frozen_rms_norm(f_parts, f, module.post_feedforward_layernorm)
        del f_parts
        maps["FF"][:, rows, :cols] = score("FF", ffp, rows)
        ff_err[:, rows] = (ffp.sum(2) - layer.ff_post_out[:, rows]).abs().amax(-1)
        hp.add_(ffp)
        del ffp
        if branch is not None:
            r = torch.arange(rows.start, rows.stop, device=hp.device)
            hp[:, r - rows.start, r] += branch[:, rows]
        hp.mul_(c)
        maps["RES2"][:, rows, :cols] = score("RES2", hp, rows)
        layer_err[:, rows] = (hp.sum(2) - layer.layer_out[:, rows]).abs().amax(-1)
        del hp
    return decoder.finish_scope_maps(maps, ff_err, layer_err, valid, causal, options.contribution)


class SandwichPerLayerInputKind(SandwichKind):
    r"""Gemma 4's layers: the sandwich kind's attention block, its own logit form and DecompX step (module docstring)."""

    name = "sandwich_per_layer_input"
    methods = frozenset({"maps", "alti", "ff", "decompx", "alti_logit", "routes"})
    capture = PER_LAYER_INPUT_CAPTURE
    #: DecompX's adjoint: a layer reusing another layer's values hands the cotangent of their source on
    adjoint = True
    #: DecompX's step reads the value projection from the layer module itself (v_proj, k_proj or none)
    reads_value_projection = False

    def require(self, method: str, family: str) -> None:
        r"""Raise :class:`UnsupportedModelError` for a method this kind does not decompose, naming why and what does."""
        if method in self.methods:
            return
        raise UnsupportedModelError(
            f"{family} has {self.name} layers: the {method!r} decomposition is not implemented for them (it is "
            "not defined for this layer kind). DecompXAttribution, ALTILogitAttribution, GlobEncAttribution, "
            "ALTIAttribution, FFIntegratedDecomposition, InformationFlowRoutes (and the LLM API, "
            "DecompositionLLMAttribution, with any of them) decompose these layers exactly; see docs/frontier.md, "
            "\"Gemma 4\"")

    def route_form(self, layer):
        r"""The sandwich kind's pre-LN form: N_pa's scale 1 / r_pa,i on the probabilities' rows, its gain on W_O."""
        return pre_ln_form(layer)

    def route_output_edges(self, layer):
        r"""c h_i (``"residual"``), c N_pf(FF)_i (``"ff"``) and, with per-layer inputs, c B_i (``"per_layer_input"``)."""
        module = _extra(layer, "module")
        c = module.layer_scalar.detach().to(device=layer.hidden_in.device, dtype=layer.hidden_in.dtype)
        parts, kinds = [layer.ln2_in * c, layer.ff_post_out * c], ("residual", "ff")
        if getattr(module, "hidden_size_per_layer_input", 0):
            z = layer.ln2_in + layer.ff_post_out
            parts.append(per_layer_input_branch(module, z, _extra(layer, "per_layer_input")) * c)
            kinds += ("per_layer_input",)
        return torch.stack(parts, -2), kinds

    def route_value_layer(self, layer):
        r"""The last storing layer of the layer's attention type where it reuses keys and values, else the layer."""
        attention = _extra(layer, "module").self_attn
        if not attention.is_kv_shared_layer:
            return layer.index
        config = attention.config
        types, modes = config.layer_types, config.kv_sharing_modes
        stores = [k for k in range(layer.index) if types[k] == attention.layer_type and modes[k] == "store"]
        if not stores:
            raise UnsupportedModelError(f"layer {layer.index} reuses keys and values that no earlier layer of the "
                                        "model computes (every layer shares them): there is no route to their source")
        return stores[-1]

    def scope_maps(self, layer, valid, options):
        r"""The FF component scopes of :func:`per_layer_input_scope_maps`."""
        return per_layer_input_scope_maps(layer, valid, options)

    def logit_form(self, layer):
        r"""The C_l-scaled pre-LN form: attention update C_l A_l, FF update C_{l+1} y_l - C_l h_l, stream C_l x_l."""
        view = pre_ln_form(layer)
        c_l = _extra(layer, "stream_scale").to(layer.hidden_in.dtype)
        module = _extra(layer, "module")
        c = module.layer_scalar.detach().to(device=layer.hidden_in.device, dtype=layer.hidden_in.dtype)
        view.out_weight = view.out_weight * c_l
        view.hidden_in = layer.hidden_in * c_l
        view.ff_out = layer.layer_out * (c_l / c) - layer.ln2_in * c_l
        return view

    def decompx_step(self, parts, bias, layer, value_weight, value_bias, bias_mode="separate", rows=None,
                     memory_budget_mb=256.0, coefs=None):
        if bias is not None and bool(torch.any(bias != 0)):
            raise UnsupportedModelError(f"layer {layer.index}: a per-layer-input layer has no bias, so no bias part "
                                        "reaches it (the capture saw one)")
        coefs = None if coefs is None else {k: coefs[k] for k in ("gate", "up") if k in coefs} or None
        out, _ = layer_step(_extra(layer, "module"), parts, _step_record(layer), _extra(layer, "shared_values"),
                            coefs=coefs)
        if rows is not None:
            out = out[:, rows.to(out.device)]
        return out, out.new_zeros(out.shape[0], out.shape[1], out.shape[3])

    def frozen_layer(self, x, layer, value_weight, value_bias, with_bias, coefs, rows=None):
        r"""J_l x of a layer that computes its own values (Gemma 4 has no bias; the branch is token-own:
        :meth:`frozen_layer_own`); a layer reusing an earlier layer's values also reads that layer's input."""
        source = self.frozen_value_source(layer)
        if source is not None:
            raise UnsupportedModelError(f"layer {layer.index} reuses the values of layer {source}: its frozen map "
                                        "also reads that layer's input (frozen_layer_source_vjp transposes it)")
        return frozen_per_layer_input_layer(x, _extra(layer, "module"), _step_record(layer), coefs, rows)

    def frozen_layer_vjp(self, g, layer, value_weight, coefs, rows=None, valid=None):
        r"""J_l^T g (:func:`~captum_normattr.decompose.methods.decompx.frozen_per_layer_input.per_layer_input_layer_vjp`)."""
        g_x, _ = per_layer_input_layer_vjp(g, layer.hidden_in, _extra(layer, "module"), _step_record(layer), coefs,
                                           rows)
        return g_x

    def frozen_layer_source_vjp(self, g, layer, coefs, source_input, rows=None):
        r"""(J_l^T g, V_l^T g) of a layer reusing the values of layer :meth:`frozen_value_source`."""
        source = _extra(layer, "layer_modules")[self.frozen_value_source(layer)]
        return per_layer_input_layer_vjp(g, layer.hidden_in, _extra(layer, "module"), _step_record(layer), coefs,
                                         rows, source, source_input)

    def frozen_layer_own(self, layer, rows=None):
        r"""c times the per-layer-input branch at its real value: token t's own part at row t."""
        return per_layer_input_layer_own(layer, _extra(layer, "module"), layer.extras.get("per_layer_input"), rows)

    def join_checks(self, layer):
        module = _extra(layer, "module")
        c = module.layer_scalar.detach().to(device=layer.hidden_in.device, dtype=layer.hidden_in.dtype)
        z = layer.ln2_in + layer.ff_post_out
        if getattr(module, "hidden_size_per_layer_input", 0):
            z = z + per_layer_input_branch(module, z, _extra(layer, "per_layer_input"))
        checks = {
            **self.post_norm_checks(layer),
            "layer output vs the layer scalar times the stream plus the feed-forward post-norm output and the "
            "per-layer-input branch": relative_difference(layer.layer_out, z * c, temporary=True),
        }
        if not getattr(module, "enable_moe_block", False):  # with experts the post-norm reads N_pf1(FF) + N_pf2(E)
            checks["feed-forward post-norm input vs the feed-forward output"] = relative_difference(
                layer.ff_post_in, layer.ff_out)
        return checks
