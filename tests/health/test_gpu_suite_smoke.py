r"""``benchmarks/gpu_suite.py --smoke``: the GPU suite's code path at tiny sizes on the CPU (no GPU needed)."""
import importlib.util
import json
import os

import pytest

SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "gpu_suite.py")


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_runs_every_part_and_writes_json(suite, tmp_path, capsys):
    out = tmp_path / "suite.json"
    assert suite.main(["--smoke", "--tokens", "12", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    kinds = {(r["kind"], r["method"]) for r in res["equality"]}
    assert {k for k, _ in kinds} == {"bert", "gpt2", "llama", "vit", "marian"}
    assert ("llama", "alti_logit") in kinds and ("bert", "decompx") in kinds and ("marian", "alti_plus") in kinds
    assert all(r["ok"] and r["dtype"] == "float64" and r["rel_error"] == 0.0 for r in res["equality"]), res["equality"]
    stack = {(r["method"], r["layers"]) for r in res["stack"] if "seconds" in r}
    assert stack == {(m, n) for m in suite.STACK_METHODS for n in (2, 4)}
    proj = {r["method"]: r for r in res["projection"]}
    assert set(proj) == set(suite.STACK_METHODS) and all("ratio_32" in r for m, r in proj.items() if m != "forward")
    table = capsys.readouterr().out
    assert "| equality | llama | ALTI-Logit |" in table and "32 layers 12 tok (projected)" in table


def test_equality_catches_a_device_difference(suite, monkeypatch):
    r"""The comparison can fail: a model copy that differs from the CPU model is reported as FAIL."""
    real = suite.copy.deepcopy

    def perturbed(obj, *args):
        twin = real(obj, *args)
        if isinstance(twin, suite.torch.nn.Module):
            with suite.torch.no_grad():
                next(twin.parameters()).add_(1e-3)
        return twin

    monkeypatch.setattr(suite.copy, "deepcopy", perturbed)
    rows = suite.run_equality(suite.torch.device("cpu"), ["llama"])
    assert rows and not any(r["ok"] for r in rows) and all(r["rel_error"] > 1e-6 for r in rows)
