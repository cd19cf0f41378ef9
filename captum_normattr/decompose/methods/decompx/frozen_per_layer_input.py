r"""DecompX's adjoint through Gemma 4's per-layer-input layers (docs/decompx.md, "The adjoint on Gemma 4 and Qwen3-VL").

With every nonlinear quantity frozen (the norms' and the value norm's scales, the attention
probabilities, the gated feed-forward's and the experts' coefficients, the routing, the
per-layer-input gate) Gemma 4's layer l is

    y_l = J_l x_l + V_l x_s + o_l

with x_l its input, x_s the input of the earlier layer s whose keys and values it reuses
(``num_kv_shared_layers``; V_l = 0 and no x_s for a layer that computes its own), and o_l the
per-layer-input branch c N_ple((act(z W_gate) * e_t) W_proj) at its real value: token t's OWN
part at row t (its gate frozen, e_t a function of token t alone), as DecompX's forward step gives
it (:func:`~captum_normattr.decompose.kinds.per_layer_input.layer_step`). The linear map is
exactly that step applied to one part (``own_branch=False``), so the adjoint and the forward
algorithm freeze the same quantities; its transpose is taken by autograd through the step (the
map is linear, so the point does not matter: it is evaluated at 0). The adjoint's walk
(:class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass`) gives the cotangent of
x_s to layer s's input when it gets there, and adds <g_(l+1),t, o_l,t> to token t's score.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.decompose.kinds.per_layer_input import (
    SharedValueParts,
    layer_step,
    per_layer_input_branch,
    store_value_parts,
)
from captum_normattr.decompose.primitives.gated_feed_forward import local_autograd
from captum_normattr.decompose.records import LayerTensors

__all__ = ["frozen_per_layer_input_layer", "per_layer_input_layer_own", "per_layer_input_layer_vjp"]


def _dense_coefficients(coefs: Optional[Dict[str, Tensor]]) -> Optional[Dict[str, Tensor]]:
    r"""The dense feed-forward's coefficients the step takes (as the kind's DecompX step passes them)."""
    return None if coefs is None else {k: coefs[k] for k in ("gate", "up") if k in coefs} or None


def frozen_per_layer_input_layer(
    x: Tensor, module: nn.Module, rec: Dict[str, Tensor], coefs: Optional[Dict[str, Tensor]],
    rows: Optional[Tensor] = None, source: Optional[nn.Module] = None, x_source: Optional[Tensor] = None,
    source_input: Optional[Tensor] = None,
) -> Tensor:
    r"""J_l x + V_l x_s of the module docstring (no per-layer-input branch): (B, R, D).

    Args:
        x: (B, T, D) a vector at the layer input; module: the layer module.
        rec: the real tensors :func:`~captum_normattr.decompose.kinds.per_layer_input.layer_step` reads.
        coefs: its :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients` (or None).
        rows: (R,) output rows (default all).
        source: the module of the layer s whose keys and values it reuses (None: its own); x_source:
            (B, T, D) a vector at x_s (0 if None); source_input: (B, T, D) the real x_s.
    """
    shared = SharedValueParts()
    if source is not None:
        if source_input is None:
            raise ValueError("a layer that reuses an earlier layer's values needs that layer's real input")
        xs = torch.zeros_like(x) if x_source is None else x_source
        store_value_parts(source, xs.unsqueeze(2), source_input, shared)
    out, _ = layer_step(module, x.unsqueeze(2), rec, shared, coefs=_dense_coefficients(coefs), own_branch=False)
    out = out.squeeze(2)
    return out if rows is None else out[:, rows.to(out.device)]


def per_layer_input_layer_own(layer: LayerTensors, module: nn.Module, per_layer_input: Optional[Tensor],
                              rows: Optional[Tensor] = None) -> Optional[Tensor]:
    r"""o_l of the module docstring at ``rows``, (B, R, D): c times the real per-layer-input branch; None without it.

    Args:
        layer: the layer's record (``ln2_in`` + ``ff_post_out`` is the branch's real gate input z); module: the
            layer module; per_layer_input: (B, T, P) e; rows: (R,) or None.
    """
    if not getattr(module, "hidden_size_per_layer_input", 0):
        return None
    z = layer.ln2_in + layer.ff_post_out
    c = module.layer_scalar.detach().to(device=z.device, dtype=z.dtype)
    own = per_layer_input_branch(module, z, per_layer_input) * c
    return own if rows is None else own[:, rows.to(own.device)]


def per_layer_input_layer_vjp(
    g: Tensor, hidden: Tensor, module: nn.Module, rec: Dict[str, Tensor], coefs: Optional[Dict[str, Tensor]],
    rows: Optional[Tensor] = None, source: Optional[nn.Module] = None, source_input: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    r"""(J_l^T g, V_l^T g): the cotangents of x_l and (with ``source``) of x_s, (..., B, T, D) each.

    Args:
        g: (..., B, R, D) cotangent(s) of the layer output at ``rows`` (leading dimensions: a stack, one
            transpose each); hidden: (B, T, D) the real layer input (its shape); the rest as in
            :func:`frozen_per_layer_input_layer`.
    """
    lead = g.shape[:-3]
    flat = g.reshape(-1, *g.shape[-3:])
    with local_autograd():
        x = torch.zeros(hidden.shape, dtype=g.dtype, device=g.device, requires_grad=True)
        leaves = [x]
        xs = None
        if source is not None:
            xs = torch.zeros(hidden.shape, dtype=g.dtype, device=g.device, requires_grad=True)
            leaves.append(xs)
        y = frozen_per_layer_input_layer(x, module, rec, coefs, rows, source, xs, source_input)
        got = [torch.autograd.grad(y, leaves, grad_outputs=gi, retain_graph=k + 1 < flat.shape[0])
               for k, gi in enumerate(flat)]
    g_x = torch.stack([t[0] for t in got]).reshape(*lead, *hidden.shape).detach()
    g_s = None if source is None else torch.stack([t[1] for t in got]).reshape(*lead, *hidden.shape).detach()
    return g_x, g_s
