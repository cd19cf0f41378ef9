r"""The capture of Gemma 4's layers beyond a sandwich layer's record (docs/frontier.md, "Gemma 4").

A per-layer-input layer (:attr:`~captum_normattr.arch.spec.Layer.per_layer_input`) is recorded as a
sandwich layer by the recorder (:mod:`captum_normattr.models.capture.recorder`: the real attention
probabilities and values, its four norms' inputs and outputs, the dense feed-forward's output); the
hooks here add what its layer kind (:mod:`captum_normattr.decompose.kinds.sandwich_per_layer_input`)
reads beyond that, into the record's ``extras``:

- ``per_layer_input``: e, the layer call's second argument (B, T, P), where the layer has the branch;
- ``route_weights``, ``route_index``: the expert block's routing, the router's outputs (``enable_moe_block``);
- ``module``: the layer module, whose weights the kind's DecompX step reads (the value projection it
  uses, the value norm's epsilon, the expert and branch weights, the layer scalar);
- ``shared_values``: the forward pass's :class:`~captum_normattr.decompose.kinds.per_layer_input.SharedValueParts`
  (one per recorder: the layers that store their keys and values leave their value parts there for
  the layers that reuse them);
- ``layer_modules``: every layer module of the model, in order (a layer that reuses keys and values reads the
  weights of the layer that stored them: DecompX's adjoint);
- ``stream_scale``: C_l, the product of the layer scalars of this layer and every later one (ALTI-Logit's
  logit form).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from captum_normattr.decompose.kinds.per_layer_input import SharedValueParts

__all__ = ["per_layer_input_extras", "per_layer_input_hooks"]

_SHARED = "_shared_values"


def per_layer_input_hooks(recorder: Any, idx: int, layer: nn.Module) -> list:
    r"""Hooks that record layer ``idx``'s per-layer input and its expert block's routing (see the module docstring).

    Args:
        recorder: the :class:`~captum_normattr.models.capture.recorder.Recorder` (its ``_keep`` and ``records``).
        idx: the layer's index; layer: the layer module.

    Returns:
        The hooks' handles.

    Raises:
        ValueError: the layer lacks the attributes of Gemma 4's layer that the kind's step reads.
    """
    missing = [name for name in ("layer_scalar", "hidden_size_per_layer_input") if not hasattr(layer, name)]
    attention = getattr(layer, "self_attn", None)
    missing += [f"self_attn.{name}" for name in ("is_kv_shared_layer", "store_full_length_kv", "layer_type")
                if not hasattr(attention, name)]
    if missing:
        raise ValueError(f"layer {idx} ({type(layer).__name__}) has no {missing}: the per-layer-input description "
                         "(Gemma 4's layer) does not match the model")
    store = getattr(recorder, _SHARED, None)
    if store is None:  # one store of shared value parts per recorder (per forward pass)
        store = SharedValueParts()
        setattr(recorder, _SHARED, store)

    def keep_input(module, args, kwargs=None):
        if not recorder._mine() or kwargs is None:
            return
        e = args[1] if len(args) > 1 else kwargs.get("per_layer_input")
        if isinstance(e, Tensor):
            recorder._keep(idx, "per_layer_input", e)
        recorder.records.setdefault(idx, {})[_SHARED] = store

    def keep_route(module, args, output):
        if recorder._mine():
            recorder._keep(idx, "route_weights", output[1])
            recorder._keep(idx, "route_index", output[2])

    handles = [layer.register_forward_pre_hook(keep_input, with_kwargs=True)]
    if getattr(layer, "enable_moe_block", False):
        handles.append(layer.router.register_forward_hook(keep_route))
    return handles


def per_layer_input_extras(layer: nn.Module, layers: List[nn.Module], idx: int, rec: Dict[str, Any],
                           cast: Callable[[Optional[Tensor]], Optional[Tensor]], width: int) -> Dict[str, Any]:
    r"""The record's ``extras`` of a per-layer-input layer (see the module docstring).

    Args:
        layer: the layer module; layers: every layer module of the model, in order; idx: the layer's index.
        rec: its recorded tensors; cast: to the compute dtype and the record's device.
        width: the per-layer inputs' width (the config attribute :attr:`~captum_normattr.arch.spec.Layer.per_layer_input`
            names; 0: the layers have no per-layer-input branch).

    Raises:
        RuntimeError: the forward pass recorded no per-layer input of a layer that has the branch, or no
            routing of a layer with experts.
    """
    scale = torch.ones((), dtype=torch.float64)
    for later in layers[idx:]:
        scale = scale * later.layer_scalar.detach().to(device="cpu", dtype=torch.float64).reshape(())
    extras: Dict[str, Any] = {"module": layer, "shared_values": rec.get(_SHARED), "stream_scale": cast(scale),
                              "layer_modules": tuple(layers)}
    needed = (["per_layer_input"] if width else []) + (
        ["route_weights", "route_index"] if getattr(layer, "enable_moe_block", False) else [])
    missing = [k for k in needed if k not in rec] + (["the shared value parts"] if extras["shared_values"] is None
                                                     else [])
    if missing:
        raise RuntimeError(f"layer {idx}: the forward pass recorded no {missing}; the per-layer-input description "
                           "does not match the model")
    for key in needed:
        t = rec[key]
        extras[key] = t.detach().to(device=extras["stream_scale"].device) if key == "route_index" else cast(t)
    return extras
