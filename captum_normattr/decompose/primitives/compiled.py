r"""The one switch of the ``torch.compile`` kernels (docs/performance.md, "Compiled kernels").

Two computations run faster as fused kernels than as batched products: the ALTI distances
(:mod:`~captum_normattr.decompose.methods.alti`) and the quadratic forms of the norm maps
(:mod:`~captum_normattr.decompose.primitives.attention`). Each module decides whether a layer is large
enough to repay a compilation; this module owns what they share: the process-wide switch,
the environment variable, one compiled function per kernel, and the fallback to the eager
code (with one warning per kernel) when a compilation fails.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Dict, Optional

import torch

__all__ = [
    "COMPILE_ENV",
    "compile_setting",
    "compiled_kernel",
    "has_failed",
    "kernel_failed",
    "use_compiled_kernels",
]

#: Environment variable: ``0`` disables the compiled kernels, ``1`` uses them at every size.
COMPILE_ENV = "CAPTUM_NORMATTR_COMPILE"

_FORCED: Dict[str, Optional[bool]] = {"value": None}
_COMPILED: Dict[Callable, Callable] = {}
_FAILED: Dict[Callable, str] = {}
_LOCK = threading.Lock()


def use_compiled_kernels(enabled: Optional[bool] = None) -> None:
    r"""Choose between the compiled and the eager kernels for the whole process.

    Args:
        enabled: True: the compiled kernels for every layer (float64 too); False: the eager
            kernels always; None (default): each kernel's own rule (float32 layers large
            enough to repay the compilation). The environment variable
            ``CAPTUM_NORMATTR_COMPILE`` (``0``/``1``) gives the default of this setting.

    Examples::

        >>> use_compiled_kernels(False)  # e.g. a one-off call on a machine without a C++ compiler
        >>> use_compiled_kernels(None)
    """
    _FORCED["value"] = enabled


def compile_setting() -> Optional[bool]:
    r"""The switch in force: :func:`use_compiled_kernels`, else the environment variable, else None."""
    forced = _FORCED["value"]
    if forced is None:
        forced = {"0": False, "1": True}.get(os.environ.get(COMPILE_ENV, "").strip())
    return forced


def compiled_kernel(fn: Callable, wanted: bool) -> Optional[Callable]:
    r"""``fn`` compiled (``dynamic=True``, once per process) if it should and can be used, else None.

    Args:
        fn: the eager definition of the kernel.
        wanted: the kernel's own rule says the layer repays a compilation (used when the
            switch is None).

    Returns:
        The compiled function, or None: the switch is off, the rule says no, or an
        earlier compilation of ``fn`` failed.
    """
    if fn in _FAILED:
        return None
    forced = compile_setting()
    if forced is False or (forced is None and not wanted):
        return None
    with _LOCK:
        if fn not in _COMPILED:
            try:
                _COMPILED[fn] = torch.compile(fn, dynamic=True)
            except Exception as e:  # no compiler backend in this torch build
                kernel_failed(fn, e)
                return None
    return _COMPILED[fn]


def kernel_failed(fn: Callable, error: BaseException) -> None:
    r"""Record that ``fn``'s compiled kernel failed (it is not tried again) and warn once."""
    _FAILED[fn] = f"{type(error).__name__}: {error}"
    warnings.warn(
        f"captum_normattr: the compiled kernel {fn.__name__} is unavailable ({_FAILED[fn]}); "
        f"using the eager kernel (set {COMPILE_ENV}=0 to skip the attempt)",
        RuntimeWarning,
        stacklevel=3,
    )


def has_failed(fn: Callable) -> bool:
    r"""Whether the compilation of ``fn`` failed in this process."""
    return fn in _FAILED
