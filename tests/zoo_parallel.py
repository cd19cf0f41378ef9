r"""Tiny-model builders of the parallel family group (merged into ``zoo.BUILDERS``; see tests/zoo.py).

``BUILDERS``: registry key -> builder(head="lm" or "cls", seed=0, **config_overrides) returning a
float64 (float32 where the family's kernels refuse float64) model with perturbed weights.
Import zoo's helpers inside the builders (``from zoo import _finish``): zoo imports this module.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

BUILDERS: Dict[str, Callable[..., torch.nn.Module]] = {}
