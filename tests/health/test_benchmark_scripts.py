r"""The benchmark scripts run as documented, each in a subprocess from the repository root (no test imports one).

- ``benchmarks/self_check.py``: the shared helpers (``_bench.py``, ``ab_compare.py``, the GPU
  suite's equality check failing on a perturbed copy);
- ``benchmarks/speed/gpu_suite.py --smoke``: the GPU suite's code path at tiny sizes on the CPU;
- the rebuild command written in ``benchmarks/RESULTS.md`` regenerates RESULTS.md itself;
- ``benchmarks/faithfulness/decoder_faithfulness.py --report``: the report of a results JSON.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
STACK_METHODS = ("forward", "globenc", "alti", "alti_logit", "decompx")  # gpu_suite.py's stack rows


def _run(argv: List[str], timeout: float = 600) -> subprocess.CompletedProcess:
    r"""``python <argv>`` from the repository root, this checkout's package first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}: exit status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_self_check_runs_every_check():
    out = _run(["benchmarks/self_check.py"]).stdout
    ok = set(re.findall(r"^ok (\w+)$", out, re.M))
    assert ok == {"rss_mb", "measure_peak", "measure_peak_on_exceed", "time_interleaved", "run_child", "random_ids",
                  "llama_model_and_decoder_runner", "ab_compare_imports_another_version",
                  "gpu_suite_equality_can_fail"}, out
    assert "9 checks, 0 failed" in out


def test_gpu_suite_smoke_runs_every_part_and_writes_json(tmp_path):
    out = tmp_path / "suite.json"
    table = _run(["benchmarks/speed/gpu_suite.py", "--smoke", "--tokens", "12", "--out", str(out)]).stdout
    res = json.loads(out.read_text())
    kinds = {(r["kind"], r["method"]) for r in res["equality"]}
    assert {k for k, _ in kinds} == {"bert", "gpt2", "llama", "vit", "marian"}
    assert ("llama", "alti_logit") in kinds and ("bert", "decompx") in kinds and ("marian", "alti_plus") in kinds
    assert all(r["ok"] and r["dtype"] == "float64" and r["rel_error"] == 0.0 for r in res["equality"]), res["equality"]
    stack = {(r["method"], r["layers"]) for r in res["stack"] if "seconds" in r}
    assert stack == {(m, n) for m in STACK_METHODS for n in (2, 4)}
    proj = {r["method"]: r for r in res["projection"]}
    assert set(proj) == set(STACK_METHODS) and all("ratio_32" in r for m, r in proj.items() if m != "forward")
    assert "| equality | llama | ALTI-Logit |" in table and "32 layers 12 tok (projected)" in table


def test_documented_results_rebuild_command_reproduces_results_md(tmp_path):
    r"""The rebuild command written in RESULTS.md regenerates RESULTS.md itself, cost table included."""
    text = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    commands = [c for c in re.findall(r"`(python benchmarks/faithfulness/faithfulness_sst2\.py [^`]*)`", text)
                if "--render-only" in c]
    assert len(commands) == 1, commands
    copy = tmp_path / "RESULTS.md"
    copy.write_text(text, encoding="utf-8")
    _run(shlex.split(commands[0])[1:] + ["--results-md", str(copy)])
    assert copy.read_text(encoding="utf-8") == text


def test_decoder_faithfulness_report_states_costs_and_paired_differences(tmp_path):
    r"""``--report``: the per-task table, the cost subsample, paired differences and medians from per-item values."""
    from captum_normattr.evaluation.statistics import mean_se

    methods = {m: {"top1_no_sink": mean_se([1.0] * 4), "cost_forwards": mean_se([2.0])}
               for m in ("ALTI-Logit", "IG-16", "Random")}
    per_item = {"ALTI-Logit": {"deletion_aopc_no_sink": [3.0, 5.0, 1.0, 2.0]},
                "IG-16": {"deletion_aopc_no_sink": [1.0, 2.0, 2.0, 0.0]},
                "Random": {"deletion_aopc_no_sink": [0.0, 1.0, 0.0, 0.0]}}
    res = {"cost_every": 5, "tasks": {"sva": {"candidates": 9, "correct": 8, "evaluated": 4, "methods": methods,
                                               "per_item": per_item,
                                               "example": {"text": "The keys", "target": " are", "foil": " is",
                                                           "evidence": [" keys"]}}},
           "exactness": {"exact RMSNorm": {"ALTI-Logit |sum - d| / |d|": {"median": 1e-12, "max": 3e-12, "n": 5}}}}
    path = tmp_path / "res.json"
    path.write_text(json.dumps(res))
    text = _run(["benchmarks/faithfulness/decoder_faithfulness.py", "--report", str(path)]).stdout
    assert "#### sva: 4 items (of 8 right among 9 candidates)" in text
    assert "× forward measured on 1 of the 4 items (every 5th, from the first)." in text
    # differences 2, 3, -1, 2: mean 1.5, s.e. sqrt(((0.5^2 + 1.5^2 + 2.5^2 + 0.5^2) / 3) / 4)
    assert "Paired differences of deletion AOPC (no sink), same items, mean ± s.e.: ALTI-Logit − IG-16 = 1.500 ± 0.866." in text
    assert ("ALTI-Logit 2.500, IG-16 1.500, Random 0.000; ALTI-Logit > IG-16 on 3 of 4 items; "
            "ALTI-Logit > Random on 4 of 4 items.") in text
    assert "| ALTI-Logit \\|sum - d\\| / \\|d\\| | 1.0e-12 | 3.0e-12 | 5 |" in text
