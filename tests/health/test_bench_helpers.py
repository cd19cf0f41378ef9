"""Fast tests of the shared benchmark helpers in benchmarks/_bench.py (no models, no timing assertions)."""
from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _bench  # noqa: E402


def test_rss_mb_is_positive():
    r = _bench.rss_mb()
    assert math.isnan(r) or r > 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_measure_peak_sees_an_allocation_inside_fn():
    def allocate(n_mb: int) -> None:
        x = torch.ones(n_mb * 2**18, dtype=torch.float32)  # n_mb MiB, touched
        x.add_(1)
        del x

    extra, seconds = _bench.measure_peak(allocate, 200)
    assert extra > 150, extra  # the 200 MiB tensor, freed before the call returns
    assert seconds >= 0
    small, _ = _bench.measure_peak(lambda: None)
    assert small < 50, small


def test_measure_peak_calls_on_exceed():
    seen = []
    extra, _ = _bench.measure_peak(lambda: torch.ones(100 * 2**18).add_(1), limit_mb=-1.0, on_exceed=seen.append)
    assert seen and seen[0] > -1.0
    with pytest.raises(ValueError, match="on_exceed"):
        _bench.measure_peak(lambda: None, limit_mb=1.0)


def test_time_interleaved_returns_every_name_and_respects_limits():
    calls = {"a": 0, "b": 0, "slow": 0}
    grad = []

    def make(n):
        def fn(x):
            calls[n] += 1
            grad.append(torch.is_grad_enabled())
            return x + 1
        return fn

    med = _bench.time_interleaved({n: make(n) for n in calls}, (torch.ones(2),), 3,
                                  max_repeats={"slow": 1}, no_warm_up=["slow"])
    assert set(med) == {"a", "b", "slow"}
    assert all(v >= 0 for v in med.values())
    assert calls == {"a": 4, "b": 4, "slow": 1}  # warm-up + 3 repeats; slow: no warm-up, 1 repeat
    assert not any(grad)  # under torch.no_grad()
    with pytest.raises(ValueError, match="unknown run names"):
        _bench.time_interleaved({"a": make("a")}, (torch.ones(1),), 1, no_warm_up=["typo"])


def test_run_child_parses_last_json_line_and_reports_failures(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        mode = sys.argv[1]
        print("log line")
        print(json.dumps({"n": 1}))
        print(json.dumps({"n": 2, "arg": sys.argv[2]}))
        if mode == "crash":
            sys.stderr.write("Traceback: something broke\\n")
            sys.exit(2)
        if mode == "abort":
            sys.exit(3)
    """))
    assert _bench.run_child(str(script), ["ok", 7]) == {"n": 2, "arg": "7"}
    assert _bench.run_child(str(script), ["abort", "x"], ok_returncodes=(0, 3))["n"] == 2
    with pytest.raises(RuntimeError, match=r"(?s)exit status 2.*something broke"):
        _bench.run_child(str(script), ["crash", "x"])
    silent = tmp_path / "silent.py"
    silent.write_text("print('no json here')\n")
    with pytest.raises(RuntimeError, match="no JSON line"):
        _bench.run_child(str(silent), [], what="silent child")


def test_random_ids_reproducible_with_special_tokens():
    a = _bench.random_ids(3, 10, sep=102)
    assert a.shape == (3, 10) and a.dtype == torch.int64
    assert torch.equal(a, _bench.random_ids(3, 10, sep=102))
    assert (a[:, 0] == 101).all() and (a[:, -1] == 102).all()
    assert ((a[:, 1:-1] >= 1000) & (a[:, 1:-1] < 20000)).all()
    plain = _bench.random_ids(1, 5, low=100, high=30000, cls=None)
    assert torch.equal(plain, torch.randint(100, 30000, (1, 5), generator=torch.Generator().manual_seed(0)))


def test_documented_results_rebuild_command_reproduces_results_md(tmp_path):
    r"""The rebuild command written in RESULTS.md regenerates RESULTS.md itself, cost table included."""
    import re
    import shlex

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    commands = [c for c in re.findall(r"`(python benchmarks/faithfulness_sst2\.py [^`]*)`", text) if "--render-only" in c]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0])[2:]
    copy = tmp_path / "RESULTS.md"
    copy.write_text(text, encoding="utf-8")
    import faithfulness_sst2  # noqa: E402 (benchmarks/ is on sys.path)

    cwd = Path.cwd()
    try:
        import os

        os.chdir(repo)  # the command is run from the repository root
        faithfulness_sst2.main(argv + ["--results-md", str(copy)])
    finally:
        os.chdir(cwd)
    assert copy.read_text(encoding="utf-8") == text


def test_llama_model_and_decoder_runner_run_every_decoder_method():
    tiny = dict(_bench.LLAMA_100M, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=64)
    model = _bench.llama_model(tiny, layers=2)
    assert len(model.layers) == 2 and model.config.num_attention_heads == 4
    again = _bench.llama_model(tiny, layers=2)  # seeded: the same weights
    assert torch.equal(model.layers[0].mlp.up_proj.weight, again.layers[0].mlp.up_proj.weight)
    ids = _bench.random_ids(1, 6, low=1, high=64, cls=None)
    with torch.no_grad():
        for name in ("forward", "globenc", "alti", "alti_logit"):
            assert _bench.decoder_runner(name, model, target=5)(ids) is not None, name
    res = _bench.decoder_runner("decompx", model, target=5)(ids)
    assert res.algorithm == "adjoint" and res.scores.shape == (1, 6)
    with pytest.raises(ValueError, match="unknown decoder method"):
        _bench.decoder_runner("lime", model)


def test_ab_compare_imports_another_version_beside_this_one(tmp_path, monkeypatch):
    r"""The other version's package coexists: renamed imports, its own recording-attention name."""
    import ab_compare  # noqa: E402 (benchmarks/ is on sys.path)

    monkeypatch.setattr(sys, "path", list(sys.path))
    repo = Path(__file__).resolve().parents[2]
    base = ab_compare.import_renamed(repo, tmp_path)
    import captum_normattr
    from captum_normattr.models.capture import recorder as capture

    assert base.__name__ == "captum_normattr_base" and base is not captum_normattr
    assert base.GlobEncAttribution is not captum_normattr.GlobEncAttribution
    assert sys.modules["captum_normattr_base.models.capture.recorder"].ATTENTION_NAME == "captum_normattr_base_capture"
    assert capture.ATTENTION_NAME == "captum_normattr_capture"
    loaded = [m for m in sys.modules if m.startswith("captum_normattr_base")]
    assert all(str(sys.modules[m].__file__).startswith(str(tmp_path)) for m in loaded)
    for name in loaded:  # the copy lives in tmp_path only
        del sys.modules[name]
