r"""Per-item summaries of :mod:`captum_normattr.evaluation.statistics` (mean ± s.e., paired differences, medians, wins)."""
from __future__ import annotations

import doctest
import math

import pytest

from captum_normattr.evaluation import statistics as ST
from captum_normattr.evaluation.statistics import (
    ItemValues,
    format_mean_se,
    mean_se,
    median,
    medians_and_wins,
    paired_differences,
)


def _res(values):
    return {m: {"deletion_aopc_no_sink": v, "top1_no_sink": 1.0} for m, v in values.items()}


def test_item_values_summaries_and_paired_differences():
    st = ItemValues()
    st.add(_res({"ALTI-Logit": 3.0, "IG-16": 1.0, "Random": 0.0}))
    st.add(_res({"ALTI-Logit": 5.0, "IG-16": 2.0, "Random": 1.0}))
    assert st.done == 2
    s = st.summary()
    assert s["ALTI-Logit"]["deletion_aopc_no_sink"]["mean"] == pytest.approx(4.0)
    assert s["ALTI-Logit"]["deletion_aopc_no_sink"]["se"] == pytest.approx(1.0)  # sqrt(2 / 1 / 2)
    # differences 2 and 3: mean 2.5, s.e. sqrt(0.5 / 2) = 0.5
    assert paired_differences(st.values, "deletion_aopc_no_sink", ["ALTI-Logit"], ["IG-16"]) == [
        "ALTI-Logit − IG-16 = 2.500 ± 0.500"]
    assert paired_differences({}, "deletion_aopc_no_sink", ["ALTI-Logit"], ["IG-16"]) == []  # older JSON files


def test_mean_se_leaves_out_missing_values():
    assert mean_se([1.0, None, float("nan"), 3.0]) == {"mean": 2.0, "se": 1.0, "n": 2}
    one = mean_se([4.0])
    assert one["mean"] == 4.0 and math.isnan(one["se"]) and one["n"] == 1
    assert mean_se([])["n"] == 0 and format_mean_se(mean_se([])) == "n/a"
    assert format_mean_se(mean_se([1.0, 2.0])) == "1.500 ± 0.500"


def test_medians_and_wins():
    per = {"ALTI-Logit": {"d": [1.0, 5.0, 2.0]}, "IG-16": {"d": [2.0, 1.0, 0.0]}, "Random": {"d": [0.0, 0.0, 9.0]}}
    text = medians_and_wins(per, "d", ["ALTI-Logit"], ["IG-16", "Random"])
    assert text == ("ALTI-Logit 2.000, IG-16 1.000, Random 0.000; ALTI-Logit > IG-16 on 2 of 3 items; "
                    "ALTI-Logit > Random on 2 of 3 items")
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([3.0, 1.0, 2.0]) == 2.0


def test_docstring_examples():
    res = doctest.testmod(ST)
    assert res.failed == 0 and res.attempted >= 4
