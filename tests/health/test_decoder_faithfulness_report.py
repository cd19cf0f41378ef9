r"""The decoder faithfulness benchmark's bookkeeping (no model): per-item summaries, paired differences, report."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
df = pytest.importorskip("decoder_faithfulness")


def _res(values):
    return {m: {"deletion_aopc_no_sink": v, "top1_no_sink": 1.0} for m, v in values.items()}


def test_task_state_summaries_and_paired_differences():
    st = df.TaskState("sva", 10, [object()] * 3)
    st.add(_res({"ALTI-Logit": 3.0, "IG-16": 1.0, "Random": 0.0}))
    st.add(_res({"ALTI-Logit": 5.0, "IG-16": 2.0, "Random": 1.0}))
    assert st.done == 2
    s = st.summary()
    assert s["ALTI-Logit"]["deletion_aopc_no_sink"]["mean"] == pytest.approx(4.0)
    assert s["ALTI-Logit"]["deletion_aopc_no_sink"]["se"] == pytest.approx(1.0)  # sqrt(2 / 1 / 2)
    t = {"per_item": st.values}
    # differences 2 and 3: mean 2.5, s.e. sqrt(0.5 / 2) = 0.5
    assert df._paired(t, "deletion_aopc_no_sink", ["ALTI-Logit"], ["IG-16"]) == ["ALTI-Logit − IG-16 = 2.500 ± 0.500"]
    assert df._paired({}, "deletion_aopc_no_sink", ["ALTI-Logit"], ["IG-16"]) == []  # older JSON files


def test_report_states_the_cost_subsample():
    methods = {m: {"top1_no_sink": df.mean_se([1.0] * 4), "cost_forwards": df.mean_se([2.0])} for m in ("ALTI-Logit", "Random")}
    res = {"cost_every": 5, "tasks": {"sva": {"candidates": 9, "correct": 8, "evaluated": 4, "methods": methods,
                                               "example": {"text": "The keys", "target": " are", "foil": " is",
                                                           "evidence": [" keys"]}}}}
    text = df.report([res])
    assert "#### sva: 4 items (of 8 right among 9 candidates)" in text
    assert "× forward measured on 1 of the 4 items (every 5th, from the first)." in text


def test_medians_and_wins():
    t = {"per_item": {"ALTI-Logit": {"d": [1.0, 5.0, 2.0]}, "IG-16": {"d": [2.0, 1.0, 0.0, ]}, "Random": {"d": [0.0, 0.0, 9.0, 1.0][:3]}}}
    text = df._medians_and_wins(t, "d", ["ALTI-Logit"], ["IG-16", "Random"])
    assert text == ("ALTI-Logit 2.000, IG-16 1.000, Random 0.000; ALTI-Logit > IG-16 on 2 of 3 items; "
                    "ALTI-Logit > Random on 2 of 3 items")
    assert df._median([4.0, 1.0, 3.0, 2.0]) == 2.5
