r"""Reading a module's weights wherever they live, also under accelerate's hooks.

A model dispatched by accelerate (``cpu_offload``, ``disk_offload``, ``dispatch_model``,
``from_pretrained(device_map=...)`` with ``"cpu"`` or ``"disk"`` entries) keeps the
parameters of its offloaded modules on the ``meta`` device; the module's
``_hf_hook`` (an ``AlignDevicesHook``) loads them from its ``weights_map`` (a CPU state
dict or memory-mapped files on disk) just before the module runs and drops them again
afterwards. Every weight the decompositions read goes through :func:`module_tensor`, which
returns the parameter itself when it is real and the hook's stored copy when it is not.
Nothing is written to the module. See ``docs/design.md``, section 11 (Capture and model
state) and ``docs/scale.md``.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor, nn


class WeightsNotReachableError(RuntimeError):
    r"""Raised for a weight on the ``meta`` device that no accelerate hook holds."""


def _hooks(module: nn.Module) -> Iterator[object]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return
    stack = [hook]
    while stack:
        h = stack.pop(0)
        inner = getattr(h, "hooks", None)  # accelerate's SequentialHook
        if inner is not None:
            stack.extend(inner)
        else:
            yield h


def module_tensor(module: nn.Module, name: str, where: str = "") -> Optional[Tensor]:
    r"""The parameter or buffer ``name`` of ``module`` with its values, wherever they are kept.

    Args:
        module: any module (an ``nn.Linear``, a norm, ...), dispatched by accelerate or not.
        name: the tensor's attribute name (``"weight"``, ``"bias"``).
        where: the module's path, for the error message.

    Returns:
        The tensor (on its own device: the module's, or the CPU / memory-mapped copy of an
        offloading hook), or None if the module has no such tensor. Callers move it to the
        device and dtype they compute in.

    Raises:
        WeightsNotReachableError: the tensor is on ``meta`` and no hook of the module holds it.

    Examples::

        >>> from accelerate import cpu_offload
        >>> cpu_offload(model)
        >>> w = module_tensor(model.model.layers[0].self_attn.o_proj, "weight")  # real values, on the CPU
    """
    t = getattr(module, name, None)
    if not isinstance(t, Tensor):
        return None
    if t.device.type != "meta":
        return t
    for hook in _hooks(module):
        weights = getattr(hook, "weights_map", None)
        if weights is None:
            continue
        try:
            return weights[name]
        except KeyError:
            continue
    label = f"{where}.{name}" if where else f"{type(module).__name__}.{name}"
    raise WeightsNotReachableError(
        f"the weight {label} is on the 'meta' device and no accelerate hook holds its values, so captum_normattr "
        "cannot read it. Load the weights: from_pretrained(..., device_map=...) or accelerate's "
        "load_checkpoint_and_dispatch / dispatch_model / cpu_offload / disk_offload on a model with real weights "
        "(a model built under init_empty_weights() has none until a checkpoint is loaded into it)."
    )


def weight_and_bias(module: nn.Module, where: str = "") -> Tuple[Tensor, Optional[Tensor]]:
    r"""``(weight, bias)`` of a module wherever they live (:func:`module_tensor`); bias None if absent.

    Raises:
        WeightsNotReachableError: see :func:`module_tensor`.
        ValueError: the module has no weight.
    """
    w = module_tensor(module, "weight", where)
    if w is None:
        raise ValueError(f"module {where or type(module).__name__} has no weight")
    return w, module_tensor(module, "bias", where)


def is_dispatched(model: nn.Module) -> bool:
    r"""True for a model under accelerate's hooks (a ``device_map``, ``cpu_offload``, ...)."""
    if getattr(model, "hf_device_map", None) is not None:
        return True
    return any(getattr(m, "_hf_hook", None) is not None for m in model.modules())


def input_device(model: nn.Module, inputs: Tensor) -> torch.device:
    r"""Where a call's inputs (and its results) live.

    A plain model: the device of its parameters (inputs are moved there). A model under
    accelerate's hooks: the device the inputs already have; the hooks move them to each
    module's execution device, and the results come back to it.
    """
    if is_dispatched(model):
        return inputs.device
    device = next(model.parameters()).device
    if device.type == "meta":
        path = next(n for n, _ in model.named_parameters())
        where, _, name = path.rpartition(".")
        module_tensor(model.get_submodule(where), name, where)  # raises WeightsNotReachableError
    return device


def tensors_to(obj, device: torch.device):
    r"""``obj`` with every tensor moved to ``device``: a tensor, or a dataclass / dict / list / tuple of them.

    Used where a model's layers run on several devices (a ``device_map``): a layer's record
    (:class:`~captum_normattr.decompose.records.LayerTensors`) or contribution is moved in
    one call. Anything else (modules, callables, numbers) is returned as it is; nothing is
    copied when it is already there.
    """
    import dataclasses

    if isinstance(obj, Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: tensors_to(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: tensors_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to(v, device) for v in obj)
    return obj


__all__ = ["WeightsNotReachableError", "input_device", "is_dispatched", "module_tensor", "tensors_to", "weight_and_bias"]
