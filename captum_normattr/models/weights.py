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

A projection wrapped by peft (``peft.tuners.lora.Linear`` around its ``base_layer``, unmerged)
computes ``base(x) + sum_a scaling_a B_a A_a x`` over its active adapters: its *effective*
weight and bias are what :func:`module_tensor` returns for ``"weight"`` / ``"bias"``
(:func:`effective_lora_tensor`), so the decompositions read the numbers the forward pass
uses. Tuner layers whose forward is not a linear map of that form (DoRA and the other LoRA
variants, IA3, LoHa, LoKr, OFT, ...) are refused with :class:`UnsupportedAdapterLayerError`
(``merge_and_unload()`` gives a plain model). See ``docs/reliability.md``.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.models.quantization import ADVICE, check_quantization, dequantized, stored_weight_problem


class WeightsNotReachableError(RuntimeError):
    r"""Raised for a weight on the ``meta`` device that no accelerate hook holds."""


class UnsupportedAdapterLayerError(ValueError):
    r"""Raised for a peft tuner layer whose effective weight captum_normattr cannot read exactly."""


def is_tuner_layer(module: nn.Module) -> bool:
    r"""True for a peft tuner layer (a module that wraps a ``base_layer`` and has adapters)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def _refuse(module: nn.Module, where: str, why: str) -> UnsupportedAdapterLayerError:
    label = where or type(module).__name__
    return UnsupportedAdapterLayerError(
        f"{label} is a peft tuner layer ({type(module).__module__}.{type(module).__name__}) {why}; captum_normattr reads "
        "the exact weights of unmerged plain LoRA layers around nn.Linear / GPT-2 Conv1D only. Merge the adapters "
        "first (model = peft_model.merge_and_unload(), or merge_adapter()) and attribute the merged model."
    )


def _lora_state(module: nn.Module, where: str):
    r"""(base layer, [(adapter, A, B, scaling)] of the adapters the forward adds, sign of the merged ones).

    Mirrors ``lora.Linear.forward``: disabled adapters -> the base layer alone (after unmerging
    any merged ones, which the forward does in place: their deltas are taken out here);
    merged -> the base layer (already holding them); otherwise the base layer plus every
    active adapter that the layer has.
    """
    for attr in ("lora_A", "lora_B", "scaling"):
        if not hasattr(module, attr):
            raise _refuse(module, where, f"(no {attr}: not a LoRA layer)")
    base = module.base_layer
    if is_tuner_layer(base):
        raise _refuse(module, where, "wrapping another tuner layer")
    if not isinstance(module.lora_A, nn.ModuleDict) or not all(isinstance(m, nn.Linear) for m in module.lora_A.values()):
        raise _refuse(module, where, "whose adapters are not linear (a convolution or embedding LoRA)")
    if type(base).__name__ not in ("Linear", "Conv1D") or not isinstance(getattr(base, "weight", None), Tensor):
        raise _refuse(module, where, f"around a {type(base).__name__} (quantised or not a linear projection)")
    variants = getattr(module, "lora_variant", {}) or {}
    dora = getattr(module, "use_dora", {}) or {}
    merged = list(getattr(module, "merged_adapters", []))
    if module.disable_adapters:
        names, sign = merged, -1.0  # the forward unmerges them: base weight minus their deltas
    elif merged:
        names, sign = [], 1.0
    else:
        names, sign = [a for a in module.active_adapters if a in module.lora_A], 1.0
    for a in names:
        if a in variants or dora.get(a, False):
            raise _refuse(module, where, f"with a LoRA variant for adapter {a!r} ({type(variants.get(a)).__name__}, e.g. DoRA)")
    return base, [(a, module.lora_A[a], module.lora_B[a], module.scaling[a]) for a in names], sign


def effective_lora_tensor(module: nn.Module, name: str, where: str = "") -> Optional[Tensor]:
    r"""The weight or bias a peft LoRA ``Linear`` layer applies: base plus the active adapters' updates.

    ``W = W_base + sum_a scaling_a B_a A_a`` (transposed for a GPT-2 ``Conv1D`` base,
    ``fan_in_fan_out``), ``b = b_base + sum_a scaling_a b_{B_a}`` (``lora_bias=True``), over
    the adapters the forward pass adds (:func:`_lora_state`; dropout is the identity in eval
    mode, where the package runs the model). Every tensor is read through
    :func:`module_tensor` (accelerate-safe) and the sum is formed in the promoted dtype of
    the base and adapter weights.

    Args:
        module: a ``peft.tuners.lora.Linear``.
        name: ``"weight"`` or ``"bias"``.
        where: the module's path, for error messages.

    Returns:
        The effective tensor (a new tensor when an adapter contributes), or None for a bias
        that neither the base layer nor any adapter has.

    Raises:
        UnsupportedAdapterLayerError: a DoRA / other variant adapter, a non-linear base or adapter.
    """
    base, adapters, sign = _lora_state(module, where)
    out = module_tensor(base, name, f"{where}.base_layer" if where else "")
    for a, lora_a, lora_b, scaling in adapters:
        if name == "weight":
            w_a = module_tensor(lora_a, "weight", f"{where}.lora_A.{a}")
            w_b = module_tensor(lora_b, "weight", f"{where}.lora_B.{a}")
            dtype = torch.promote_types(torch.promote_types(w_a.dtype, w_b.dtype), out.dtype)
            delta = w_b.to(dtype) @ w_a.to(device=w_b.device, dtype=dtype)
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            out = out.to(dtype) + sign * float(scaling) * delta.to(out.device)
        else:
            b_b = module_tensor(lora_b, "bias", f"{where}.lora_B.{a}")
            if b_b is None:
                continue
            if out is None:
                out = torch.zeros_like(b_b)
            dtype = torch.promote_types(out.dtype, b_b.dtype)
            out = out.to(dtype) + sign * float(scaling) * b_b.to(device=out.device, dtype=dtype)
    return out


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
        UnsupportedAdapterLayerError: ``module`` is a peft tuner layer whose effective
            weight is not base + low-rank update (see :func:`effective_lora_tensor`).

    Examples::

        >>> from accelerate import cpu_offload
        >>> cpu_offload(model)
        >>> w = module_tensor(model.model.layers[0].self_attn.o_proj, "weight")  # real values, on the CPU
    """
    if is_tuner_layer(module) and name in ("weight", "bias"):
        return effective_lora_tensor(module, name, where)  # peft's .weight is the BASE weight: never read it
    t = getattr(module, name, None)
    if not isinstance(t, Tensor):
        problem = stored_weight_problem(module, name)
        if problem is not None:
            check_quantization(module, where or type(module).__name__)  # activation-quantizing: why, what to do
            raise UnsupportedModelError(f"{where or type(module).__name__}: {problem}; captum_normattr reads plain, "
                                        f"torchao or torch-quantized weight tensors only: {ADVICE}")
        return None
    if t.device.type != "meta":
        return dequantized(t)  # a weight-only quantized weight: the values the model multiplies by
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


__all__ = [
    "UnsupportedAdapterLayerError", "WeightsNotReachableError", "effective_lora_tensor", "input_device", "is_dispatched",
    "is_tuner_layer", "module_tensor", "tensors_to", "weight_and_bias",
]
