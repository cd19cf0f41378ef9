r"""Validation of the constructor options of every attribution class, in one place.

Every class calls these checks in its ``__init__``, so that a bad option fails when the
object is made, with a message naming the option, the value and what is allowed, and
never later as NaN, as numbers computed from a nonsensical setting, or as an opaque error
deep inside a layer. The rules (see docs/reliability.md):

=====================  =========================================================
option                 allowed
=====================  =========================================================
``steps``              int >= 1 (Riemann steps of the FF integrated gradients)
``nodes``              int >= 1, or None for the default (Gauss-Legendre nodes)
``chunk_rows``         int >= 1, or None (rows from ``memory_budget_mb``)
``memory_budget_mb``   finite number > 0
``ignore_low_gamma``   finite number in [0, 1)
``explained_position`` None, an int, ``"last"``, or a (B,) integer tensor
=====================  =========================================================

Integers are Python ints or integer numpy/torch scalars; ``True``/``False`` are refused
(a bool is an int to Python, but never a meaningful count or position here).

Examples:
    >>> check_positive_int("steps", 50)
    50
    >>> check_positive_int("steps", 0)
    Traceback (most recent call last):
    ...
    ValueError: steps must be an integer >= 1, got 0
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "check_choice",
    "check_explained_position",
    "check_fraction",
    "check_memory_budget",
    "check_optional_positive_int",
    "check_positive_int",
]


def _is_int(value: Any) -> bool:
    if isinstance(value, bool) or isinstance(value, Tensor):
        return False
    return isinstance(value, numbers.Integral)


def _is_real(value: Any) -> bool:
    if isinstance(value, bool) or isinstance(value, Tensor):
        return False
    return isinstance(value, numbers.Real)


def check_positive_int(name: str, value: Any) -> int:
    r"""``value`` as an int, or a ValueError/TypeError unless it is an integer >= 1.

    Args:
        name: the option's name, for the message.
        value: what the caller passed.

    Returns:
        int.
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer >= 1, got {value!r} ({type(value).__name__})")
    if int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {int(value)}")
    return int(value)


def check_optional_positive_int(name: str, value: Any) -> Optional[int]:
    r"""None, or ``value`` checked by :func:`check_positive_int`."""
    return None if value is None else check_positive_int(name, value)


def check_memory_budget(memory_budget_mb: Any, name: str = "memory_budget_mb") -> float:
    r"""The memory budget as a float, or a ValueError if it is not a positive, finite number of MB."""
    if not _is_real(memory_budget_mb) or not math.isfinite(float(memory_budget_mb)) or not float(memory_budget_mb) > 0:
        raise ValueError(f"{name} must be a positive, finite number of MB, got {memory_budget_mb!r}")
    return float(memory_budget_mb)


def check_fraction(name: str, value: Any) -> float:
    r"""``value`` as a float in [0, 1), or a ValueError (NaN, inf, bool and non-numbers refused)."""
    if not _is_real(value) or not math.isfinite(float(value)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    r"""``value`` if it is one of ``choices``, else a ValueError listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_explained_position(value: Any) -> Union[None, int, str, Tensor]:
    r"""Check the type of an ``explained_position`` option (its range is checked per call).

    Allowed: None (the class's default), an int (non-negative: counted from the first real
    token of each example; negative: from the last real token), ``"last"``, or a (B,)
    tensor of an integer dtype holding positions in the padded tensor.

    Returns:
        the value, ints converted to ``int``.

    Raises:
        TypeError / ValueError: for floats, bools, float or bool tensors, tensors that are
        not one-dimensional and strings other than ``"last"``.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value != "last":
            raise ValueError(f"explained_position must be an int, 'last' or a (B,) integer tensor; got {value!r}")
        return value
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"explained_position tensor must have an integer dtype (positions are never rounded); got {value.dtype}"
            )
        if value.dim() != 1:
            raise ValueError(f"explained_position tensor must be one-dimensional (B,); got shape {tuple(value.shape)}")
        return value
    if _is_int(value):
        return int(value)
    raise TypeError(
        f"explained_position must be an int, 'last' or a (B,) integer tensor; got {value!r} ({type(value).__name__})"
    )
