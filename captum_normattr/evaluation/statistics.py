r"""Summaries of per-item metric values of several methods: mean ± standard error, medians, paired differences.

A faithfulness comparison scores every method on the same items; what it reports is, per
method and metric, the mean and its standard error over the items, and, because the items
are shared, the paired differences between two methods (the mean ± s.e. of the per-item
differences, tighter than two separate intervals), the medians (per-item values such as an
AOPC relative to a small logit difference are heavy-tailed) and on how many items one
method beats another. :class:`ItemValues` gathers the values item by item;
``benchmarks/faithfulness/decoder_faithfulness.py`` reports with these functions.

Examples:
    >>> values = ItemValues()
    >>> values.add({"ALTI-Logit": {"aopc": 3.0}, "Random": {"aopc": 0.0}})
    >>> values.add({"ALTI-Logit": {"aopc": 5.0}, "Random": {"aopc": 1.0}})
    >>> format_mean_se(values.summary()["ALTI-Logit"]["aopc"])
    '4.000 ± 1.000'
    >>> paired_differences(values.values, "aopc", ["ALTI-Logit"], ["Random"])
    ['ALTI-Logit − Random = 3.500 ± 0.500']
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["ItemValues", "format_mean_se", "mean_se", "median", "medians_and_wins", "paired_differences"]

#: Per-item values: method -> metric -> one value per item, in item order.
PerItem = Mapping[str, Mapping[str, Sequence[float]]]


def mean_se(values: Sequence[Optional[float]]) -> Dict[str, float]:
    r"""Mean and standard error of the mean, None and NaN values left out.

    Args:
        values: the per-item values.

    Returns:
        ``{"mean", "se", "n"}``: se = sqrt(sum (x - mean)^2 / (n - 1) / n) (NaN for n < 2);
        mean and se NaN and n 0 when no value is left.
    """
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return {"mean": float("nan"), "se": float("nan"), "n": 0}
    m = sum(v) / len(v)
    se = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else float("nan")
    return {"mean": m, "se": se, "n": len(v)}


def format_mean_se(s: Mapping[str, float]) -> str:
    r"""``"mean ± se"`` with three decimals, ``"n/a"`` without values.

    Args:
        s: a :func:`mean_se` summary.

    Returns:
        The text.
    """
    return f"{s['mean']:.3f} ± {s['se']:.3f}" if s["n"] else "n/a"


def median(values: Sequence[float]) -> float:
    r"""The median (the mean of the two middle values for an even count).

    Args:
        values: at least one value.

    Returns:
        The median.
    """
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def paired_differences(per_item: PerItem, metric: str, ours: Sequence[str], refs: Sequence[str]) -> List[str]:
    r"""``"A − B = mean ± se"`` of the per-item differences, for every A of ``ours`` and B of ``refs``.

    Args:
        per_item: method -> metric -> per-item values (the same items, in the same order).
        metric: the metric compared.
        ours: the methods on the left of the differences.
        refs: the methods they are compared with.

    Returns:
        One text per pair where both methods have the metric (empty when none has it, as in
        JSON files written before per-item values were kept).
    """
    out = []
    for a in ours:
        for b in refs:
            if metric in per_item.get(a, {}) and metric in per_item.get(b, {}):
                diff = [x - y for x, y in zip(per_item[a][metric], per_item[b][metric])]
                out.append(f"{a} − {b} = {format_mean_se(mean_se(diff))}")
    return out


def medians_and_wins(per_item: PerItem, metric: str, ours: Sequence[str], refs: Sequence[str]) -> str:
    r"""Every method's median of a metric, and on how many items each of ``ours`` is above each reference.

    Args:
        per_item: method -> metric -> per-item values (the same items, in the same order).
        metric: the metric compared.
        ours: the methods whose wins are counted.
        refs: the methods they are compared with.

    Returns:
        ``"A 2.000, B 1.000; A > B on 2 of 3 items"`` (methods without the metric left out).
    """
    meds = ", ".join(f"{m} {median(per_item[m][metric]):.3f}" for m in [*ours, *refs] if metric in per_item.get(m, {}))
    wins = "; ".join(
        f"{a} > {b} on {sum(x > y for x, y in zip(per_item[a][metric], per_item[b][metric]))} "
        f"of {len(per_item[a][metric])} items"
        for a in ours for b in refs if metric in per_item.get(a, {}) and metric in per_item.get(b, {}))
    return f"{meds}; {wins}"


class ItemValues:
    r"""Per-item metric values of several methods, gathered one item at a time.

    Attributes:
        values: method -> metric -> the values so far, in item order.
        done: the items added.
    """

    def __init__(self) -> None:
        self.values: Dict[str, Dict[str, List[float]]] = {}
        self.done = 0

    def add(self, res: Mapping[str, Mapping[str, float]]) -> None:
        r"""Add one item's values.

        Args:
            res: method -> metric -> this item's value.
        """
        for m, rec in res.items():
            for k, v in rec.items():
                self.values.setdefault(m, {}).setdefault(k, []).append(v)
        self.done += 1

    def summary(self) -> Dict[str, Dict[str, Dict[str, float]]]:
        r"""Method -> metric -> :func:`mean_se` of its values."""
        return {m: {k: mean_se(v) for k, v in rec.items()} for m, rec in self.values.items()}
