r"""The package's one progress bar: tqdm on standard error, or a no-op.

Used by the command line (batches of texts and of encoder-decoder pairs), by dataset runs
(:mod:`captum_normattr.cli.dataset.run`, texts, main process only) and by the faithfulness harness
(:mod:`captum_normattr.evaluation.harness`, batches).
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

__all__ = ["NullBar", "progress_bar", "progress_iter"]


class NullBar:
    r"""A progress bar that shows nothing (``update`` and ``close`` do nothing)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _CountBar(NullBar):
    r"""``\rbatch k/N`` on standard error, where tqdm is not installed."""

    def __init__(self, total: int, unit: str) -> None:
        self.n, self.total, self.unit = 0, total, unit

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"\r{self.unit} {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def progress_bar(total: int, *, enabled: bool = True, desc: Optional[str] = "captum-normattr", unit: str = "batch",
                 min_total: int = 2, leave: bool = False) -> Any:
    r"""A progress bar on standard error for ``total`` steps, or a :class:`NullBar`.

    Args:
        total: the number of steps (``update(n)`` adds ``n``).
        enabled: False: a :class:`NullBar` (``-q``, ``progress=False``).
        desc: the label in front of the bar.
        unit: what a step is (``"batch"``, ``"text"``).
        min_total: fewer steps than this show no bar (the command line shows none for one batch).
        leave: keep the finished bar on the screen.

    Returns:
        An object with ``update(n=1)`` and ``close()`` (tqdm's bar, or a counter printed on
        standard error where tqdm is missing, or a :class:`NullBar`); also a context manager.

    Examples:
        >>> bar = progress_bar(3, enabled=False)
        >>> bar.update(1); bar.close()
    """
    if not enabled or total < min_total:
        return NullBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return _CountBar(total, unit)
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, leave=leave)


def progress_iter(items: Iterable[T], total: int, **kwargs: Any) -> Iterator[T]:
    r"""The items of ``items``, with a :func:`progress_bar` of ``total`` steps (``kwargs``: its options)
    advanced after each one and closed at the end (also when the loop stops early).

    Examples:
        >>> list(progress_iter([1, 2], 2, enabled=False))
        [1, 2]
    """
    bar = progress_bar(total, **kwargs)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()
