r"""Quantized models: weight-only schemes decompose exactly, activation-quantizing schemes are refused.

A decomposition splits each layer into per-token parts using the model's linear maps. That is
exact for a quantized model exactly when each quantized linear map is still a linear map of its
input with fixed weights:

* **weight-only schemes** store W compressed and compute ``x @ dequantize(W)`` (up to the
  rounding of the matrix product): torchao's weight-only configurations (``Int8WeightOnlyConfig``,
  ``Int4WeightOnlyConfig``, ... whose weights are tensor subclasses with ``dequantize()``), and
  PyTorch quantized tensors used as weights. The package reads ``dequantize(W)`` wherever it
  reads a weight (:func:`dequantized`), so the decomposition is exact with respect to the
  dequantized weights — the weights the model really multiplies by. The consistency guards
  compare the rebuilt tensors with the model's real ones as for any model.
* **schemes that quantize activations** round the INPUT of each matrix product per token (or
  per tensor) to a few bits: ``torch.ao.quantization.quantize_dynamic`` (dynamic int8), static
  ``torch.ao`` quantization, ``bitsandbytes``' LLM.int8 (``Linear8bitLt``), FP8 activation
  scaling. Rounding is not additive: round(a + b) != round(a) + round(b), so the output of a
  layer is no sum of per-token parts. These are refused with :class:`QuantizedActivationsError`
  (an :class:`~captum_normattr.arch.spec.UnsupportedModelError`) that says why and what to do:
  decompose the float model, or a weight-only quantization of it.

docs/reliability.md ("Quantized models") states what was tested here.
"""
from __future__ import annotations

from typing import List, Optional

from torch import Tensor, nn

from captum_normattr.arch.spec import UnsupportedModelError

__all__ = ["ADVICE", "QuantizedActivationsError", "activation_quantizing_modules", "check_quantization", "dequantized",
           "stored_weight_problem"]

#: module classes (by module path prefix or class name) whose forward quantizes its input activations
_ACTIVATION_QUANTIZING_PREFIXES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                                   "torch.ao.nn.qat", "torch.nn.qat")
_ACTIVATION_QUANTIZING_NAMES = ("Linear8bitLt", "FP8Linear", "QuantLinearFP8")

ADVICE = ("decompose the float model (the quantization's reference), or quantize its weights only "
          "(for example torchao's Int8WeightOnlyConfig / Int4WeightOnlyConfig with torchao.quantization.quantize_), "
          "which the package decomposes exactly with respect to the dequantized weights (docs/reliability.md, "
          "'Quantized models')")


class QuantizedActivationsError(UnsupportedModelError):
    r"""The model quantizes activations: a layer's output is no sum of per-token parts."""


def activation_quantizing_modules(model: nn.Module) -> List[str]:
    r"""Paths and classes of the modules of ``model`` whose forward quantizes its input activations.

    Args:
        model: any module.

    Returns:
        ``["path (module.Class)", ...]``, empty for float and weight-only quantized models.
    """
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        where = cls.__module__ or ""
        if cls.__name__.endswith("PackedParams"):  # the packed weights of a quantized module, not a layer
            continue
        if where.startswith(_ACTIVATION_QUANTIZING_PREFIXES) or cls.__name__ in _ACTIVATION_QUANTIZING_NAMES:
            found.append(f"{name or '<model>'} ({where}.{cls.__name__})")
    return found


def check_quantization(model: nn.Module, family: str = "this model") -> None:
    r"""Refuse a model whose layers quantize activations (see the module docstring).

    Args:
        model: the model to decompose.
        family: named in the error.

    Raises:
        QuantizedActivationsError: with the first modules found, why, and what to do.

    Examples::

        >>> import torch
        >>> q = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear})
        >>> check_quantization(q)   # raises QuantizedActivationsError
    """
    found = activation_quantizing_modules(model)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise QuantizedActivationsError(
            f"{family} is quantized with a scheme that quantizes activations ({shown}): each matrix product rounds its "
            "input to a few bits, and rounding is not additive over tokens (round(a + b) != round(a) + round(b)), so no "
            f"layer output is a sum of per-token parts and no exact decomposition exists. Instead, {ADVICE}."
        )


def dequantized(t: Tensor) -> Tensor:
    r"""The real-valued tensor a stored weight stands for: ``t`` itself for a plain tensor, else its dequantization.

    Handles PyTorch quantized tensors (``t.is_quantized``) and tensor subclasses that define
    ``dequantize()`` (torchao's quantized weights). A plain floating tensor is returned as is
    (no copy).

    Args:
        t: a weight or bias as stored in a module.

    Returns:
        A plain ``torch.Tensor``.
    """
    if type(t) is Tensor or type(t) is nn.Parameter:
        return t.dequantize() if t.is_quantized else t
    deq = getattr(t, "dequantize", None)
    if callable(deq):
        out = deq()
        if isinstance(out, Tensor):
            return out if type(out) in (Tensor, nn.Parameter) else out.as_subclass(Tensor)
    return t


def stored_weight_problem(module: nn.Module, name: str) -> Optional[str]:
    r"""Why ``module.<name>`` cannot be read as a weight tensor (None: it can, or there is none).

    torch.ao's quantized modules keep ``weight`` as a method, for example.
    """
    value = getattr(module, name, None)
    if value is None or isinstance(value, Tensor):
        return None
    return (f"{type(module).__module__}.{type(module).__name__}.{name} is a {type(value).__name__}, not a tensor "
            "(a quantized layer?)")
