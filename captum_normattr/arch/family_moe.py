r"""Family descriptions of the moe group (see :mod:`captum_normattr.arch.families` for the format).

``BUILTIN`` lists them by registry key; :mod:`captum_normattr.arch.registry` registers them after
the text families of :mod:`captum_normattr.arch.families` and before the vision ones.
"""
from __future__ import annotations

from typing import Tuple

from captum_normattr.arch.spec import ArchitectureSpec

BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = ()
