r"""Checks of the benchmarks' shared helpers at tiny sizes (no real models, no timing asserted).

Usage (from the repository root; under a minute on 2 CPU cores)::

    python benchmarks/self_check.py              # every check
    python benchmarks/self_check.py --only run_child random_ids

Prints ``ok <check>`` per check and exits with status 1 when one fails (its traceback on
stderr). ``tests/health/test_benchmark_scripts.py`` runs it, as a user would: the tests never
import a benchmark. Checked:

* ``_bench.py``: the resident-set size, the peak extra memory of a call (and its over-limit
  callback), interleaved timing (warm-ups, repeats, ``torch.no_grad``), child processes
  (their last JSON line; failures quoting stderr), seeded random ids, the seeded Llama models
  and one call of every decoder method on them;
* ``ab_compare.py``: another version of the package imported beside this one (renamed
  imports, its own recording-attention name);
* ``speed/gpu_suite.py``: the device-equality check can fail (a model copy that differs from
  the CPU model is reported as FAIL).
"""
from __future__ import annotations

import argparse
import copy
import math
import re
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Type

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))  # this checkout's package
sys.path.insert(0, str(BENCHMARKS))

import torch  # noqa: E402

import _bench  # noqa: E402

__all__ = ["CHECKS", "main"]


def _raises(exc: Type[BaseException], match: str, fn: Callable, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except exc as err:
        assert re.search(match, str(err)), f"{exc.__name__} raised, but {str(err)!r} does not match {match!r}"
        return
    raise AssertionError(f"{exc.__name__} not raised")


def check_rss_mb() -> None:
    r = _bench.rss_mb()
    assert math.isnan(r) or r > 0, r


def check_measure_peak() -> None:
    if not Path("/proc/self/status").exists():
        print("skip measure_peak: needs /proc (Linux)")
        return

    def allocate(n_mb: int) -> None:
        x = torch.ones(n_mb * 2**18, dtype=torch.float32)  # n_mb MiB, touched
        x.add_(1)
        del x

    extra, seconds = _bench.measure_peak(allocate, 200)
    assert extra > 150, extra  # the 200 MiB tensor, freed before the call returns
    assert seconds >= 0
    small, _ = _bench.measure_peak(lambda: None)
    assert small < 50, small


def check_measure_peak_on_exceed() -> None:
    seen: List[float] = []
    _bench.measure_peak(lambda: torch.ones(100 * 2**18).add_(1), limit_mb=-1.0, on_exceed=seen.append)
    assert seen and seen[0] > -1.0, seen
    _raises(ValueError, "on_exceed", _bench.measure_peak, lambda: None, limit_mb=1.0)


def check_time_interleaved() -> None:
    calls = {"a": 0, "b": 0, "slow": 0}
    grad: List[bool] = []

    def make(n):
        def fn(x):
            calls[n] += 1
            grad.append(torch.is_grad_enabled())
            return x + 1
        return fn

    med = _bench.time_interleaved({n: make(n) for n in calls}, (torch.ones(2),), 3,
                                  max_repeats={"slow": 1}, no_warm_up=["slow"])
    assert set(med) == {"a", "b", "slow"}, med
    assert all(v >= 0 for v in med.values()), med
    assert calls == {"a": 4, "b": 4, "slow": 1}, calls  # warm-up + 3 repeats; slow: no warm-up, 1 repeat
    assert not any(grad)  # under torch.no_grad()
    _raises(ValueError, "unknown run names", _bench.time_interleaved, {"a": make("a")}, (torch.ones(1),), 1,
            no_warm_up=["typo"])


def check_run_child() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
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
        _raises(RuntimeError, r"(?s)exit status 2.*something broke", _bench.run_child, str(script), ["crash", "x"])
        silent = Path(tmp) / "silent.py"
        silent.write_text("print('no json here')\n")
        _raises(RuntimeError, "no JSON line", _bench.run_child, str(silent), [], what="silent child")


def check_random_ids() -> None:
    a = _bench.random_ids(3, 10, sep=102)
    assert a.shape == (3, 10) and a.dtype == torch.int64, (a.shape, a.dtype)
    assert torch.equal(a, _bench.random_ids(3, 10, sep=102))
    assert (a[:, 0] == 101).all() and (a[:, -1] == 102).all()
    assert ((a[:, 1:-1] >= 1000) & (a[:, 1:-1] < 20000)).all()
    plain = _bench.random_ids(1, 5, low=100, high=30000, cls=None)
    assert torch.equal(plain, torch.randint(100, 30000, (1, 5), generator=torch.Generator().manual_seed(0)))


def check_llama_model_and_decoder_runner() -> None:
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
    assert res.algorithm == "adjoint" and res.scores.shape == (1, 6), (res.algorithm, res.scores.shape)
    _raises(ValueError, "unknown decoder method", _bench.decoder_runner, "lime", model)


def check_ab_compare_imports_another_version() -> None:
    r"""The other version's package coexists: renamed imports, its own recording-attention name."""
    import ab_compare

    saved_path = list(sys.path)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            base = ab_compare.import_renamed(BENCHMARKS.parent, Path(tmp))
            import captum_normattr
            from captum_normattr.models.capture import attention as capture

            assert base.__name__ == "captum_normattr_base" and base is not captum_normattr
            assert base.GlobEncAttribution is not captum_normattr.GlobEncAttribution
            assert sys.modules["captum_normattr_base.models.capture.attention"].ATTENTION_NAME == "captum_normattr_base_capture"
            assert capture.ATTENTION_NAME == "captum_normattr_capture"
            loaded = [m for m in sys.modules if m.startswith("captum_normattr_base")]
            assert all(str(sys.modules[m].__file__).startswith(str(Path(tmp).resolve())) or
                       str(sys.modules[m].__file__).startswith(tmp) for m in loaded)
        finally:
            sys.path[:] = saved_path
            for name in [m for m in sys.modules if m.startswith("captum_normattr_base")]:
                del sys.modules[name]  # the copy lives in the temporary folder only


def check_gpu_suite_equality_can_fail() -> None:
    r"""A model copy that differs from the CPU model is reported as FAIL by the GPU suite's equality rows."""
    sys.path.insert(0, str(BENCHMARKS / "speed"))
    import gpu_suite

    real = copy.deepcopy

    def perturbed(obj, *args):
        twin = real(obj, *args)
        if isinstance(twin, torch.nn.Module):
            with torch.no_grad():
                next(twin.parameters()).add_(1e-3)
        return twin

    gpu_suite.copy.deepcopy = perturbed
    try:
        rows = gpu_suite.run_equality(torch.device("cpu"), ["llama"])
    finally:
        gpu_suite.copy.deepcopy = real
    assert rows and not any(r["ok"] for r in rows) and all(r["rel_error"] > 1e-6 for r in rows), rows


#: The checks by name, in the order they run.
CHECKS: Dict[str, Callable[[], None]] = {
    name[len("check_"):]: fn for name, fn in list(globals().items()) if name.startswith("check_") and callable(fn)
}


def main(argv: Optional[List[str]] = None) -> int:
    r"""Run the checks; 0 when every one passes, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=None, help="run these checks only")
    args = p.parse_args(argv)
    failed = []
    for name in args.only or CHECKS:
        try:
            CHECKS[name]()
        except Exception:  # noqa: BLE001 (report every failing check, then fail)
            failed.append(name)
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
        else:
            print(f"ok {name}", flush=True)
    print(f"{len(CHECKS) if args.only is None else len(args.only)} checks, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
