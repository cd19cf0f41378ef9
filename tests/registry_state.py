r"""Tests that re-register architecture descriptions: restore the registry afterwards."""
from __future__ import annotations

import contextlib
from typing import Iterator

from captum_normattr.arch import ARCHITECTURES, ENCODER_DECODERS, ArchitectureSpec, register_architecture


@contextlib.contextmanager
def restored_registry() -> Iterator[None]:
    r"""Both registries (one-stack and encoder-decoder) as they were, after the block."""
    saved, saved_ed = dict(ARCHITECTURES), dict(ENCODER_DECODERS)
    try:
        yield
    finally:
        ARCHITECTURES.clear()
        ARCHITECTURES.update(saved)
        ENCODER_DECODERS.clear()
        ENCODER_DECODERS.update(saved_ed)


@contextlib.contextmanager
def described_as(key: str, spec: ArchitectureSpec) -> Iterator[ArchitectureSpec]:
    r"""The registry with ``spec`` serving ``key`` for the block (restored afterwards)."""
    with restored_registry():
        register_architecture(spec, key=key, replace=True)
        yield spec
