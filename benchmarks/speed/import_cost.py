r"""What starting the command line and importing the package cost, against ``python -c pass`` and the heavy stack.

Every row is a fresh ``python`` process (this interpreter, this checkout's package first on
``PYTHONPATH``), run ``--repeats`` times interleaved with the other rows; the table shows the
minimum wall time (the figure least disturbed by other load) and the median::

    python benchmarks/speed/import_cost.py                  # min and median of 5
    python benchmarks/speed/import_cost.py --repeats 9 --json out.json

Rows: the interpreter alone; ``captum-normattr --help``, ``generate --help`` and a usage error
as the console script runs them (:func:`captum_normattr.cli.entry.main`); ``python -m
captum_normattr --help``; ``import captum_normattr`` (lazy: imports no torch); the first use of
an attribution class (``from captum_normattr import GlobEncAttribution``); and
``import torch, transformers, captum`` and ``import torch`` alone for scale. Each process also
reports whether torch was imported. The numbers are in docs/cli.md ("Start-up time").
This script imports nothing heavy itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

__all__ = ["ROWS", "measure", "main"]

REPO = Path(__file__).resolve().parents[2]

_CLI = ("import sys; from captum_normattr.cli.entry import main; sys.stdout = open('/dev/null', 'w'); "
        "sys.stderr = sys.stdout; code = main({argv!r}); ")
_REPORT = "import sys as _s; print('TORCH' if 'torch' in _s.modules else 'NO-TORCH', file=_s.__stdout__)"

#: label -> python arguments
ROWS: Dict[str, List[str]] = {
    "python -c pass": ["-c", "pass; " + _REPORT],
    "captum-normattr --help": ["-c", _CLI.format(argv=["--help"]) + _REPORT],
    "captum-normattr generate --help": ["-c", _CLI.format(argv=["generate", "--help"]) + _REPORT],
    "captum-normattr usage error (-m globnc)": ["-c", _CLI.format(argv=["-m", "globnc", "x"]) + _REPORT],
    "python -m captum_normattr --help": ["-m", "captum_normattr", "--help"],
    "import captum_normattr": ["-c", "import captum_normattr; " + _REPORT],
    "from captum_normattr import GlobEncAttribution": ["-c", "from captum_normattr import GlobEncAttribution; "
                                                             + _REPORT],
    "import torch, transformers, captum": ["-c", "import torch, transformers, captum; " + _REPORT],
    "import torch": ["-c", "import torch; " + _REPORT],
}


def measure(rows: Dict[str, List[str]], repeats: int) -> Dict[str, Dict[str, object]]:
    r"""Wall times of every row, ``repeats`` rounds interleaved (one process per row and round).

    Returns:
        label -> {"min_s", "median_s", "runs_s", "torch"} (``torch``: the process imported it;
        None where the row does not report).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    times: Dict[str, List[float]] = {k: [] for k in rows}
    torch_seen: Dict[str, object] = {k: None for k in rows}
    for _ in range(repeats):
        for label, argv in rows.items():
            start = time.perf_counter()
            done = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
            times[label].append(time.perf_counter() - start)
            if "TORCH" in done.stdout:
                torch_seen[label] = "NO-TORCH" not in done.stdout
            elif done.returncode not in (0, 2):
                raise RuntimeError(f"{label}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    return {k: {"min_s": min(v), "median_s": statistics.median(v), "runs_s": v, "torch": torch_seen[k]}
            for k, v in times.items()}


def main(argv: Sequence[str] = ()) -> int:
    r"""Measure and print the table (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="processes per row (default 5); the table shows the min")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(list(argv))
    res = measure(ROWS, args.repeats)
    base = res["python -c pass"]["min_s"]
    print(f"{'':<48} {'min s':>7} {'median s':>9} {'- pass':>7}  torch imported")
    for label, r in res.items():
        seen = {True: "yes", False: "no", None: "-"}[r["torch"]]  # type: ignore[index]
        print(f"{label:<48} {r['min_s']:>7.3f} {r['median_s']:>9.3f} {r['min_s'] - base:>7.3f}  {seen}")
    print(f"\n{args.repeats} processes per row, interleaved; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": args.repeats, "rows": res}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
