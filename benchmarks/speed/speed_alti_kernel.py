r"""The ALTI distance kernels side by side on one decoder layer's shapes (CPU time, one thread).

For every length T it builds random causal probabilities (1, H, T, T), projected values
(1, T, H, D) and targets (1, T, D) of SmolLM2's shapes (H = 9, D = 576 by default) and times
``alti_map`` (``decompose/alti.py``) with

* the native C kernel (``decompose/native.py``; the default on a CPU where a C compiler builds it),
* the ``torch.compile`` kernel (``CAPTUM_NORMATTR_NATIVE=0``), which first copies each row
  block of the probabilities into a (source, row, head) block,

interleaved, best of ``--repeats``, after one warm-up call of each (the compilations). It also
prints the work in (pair, channel) units, T (T + 1) / 2 x D, and each kernel's nanoseconds per
unit, and checks that both maps agree (max relative difference).

Usage::

    python benchmarks/speed/speed_alti_kernel.py --tokens 1024 2048 4096 --json benchmarks/results/speed_alti_kernel.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))

import torch  # noqa: E402

from captum_normattr.decompose.methods import alti  # noqa: E402

from captum_normattr.decompose.primitives import native


def layer(t: int, heads: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, heads, t, t, generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill_(causal, float("-inf")), -1)
    projected = torch.randn(1, t, heads, width, generator=g).permute(0, 2, 1, 3)  # token-major, as the engine makes it
    residual = torch.randn(1, t, width, generator=g)
    output = torch.randn(1, t, width, generator=g)
    valid = torch.ones(1, t, dtype=torch.bool)
    return probs, projected, residual, output, valid


def timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--width", type=int, default=576)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    alti.use_compiled_kernel(True)
    rows = []
    for t in args.tokens:
        probs, projected, residual, output, valid = layer(t, args.heads, args.width)

        def run(flag: str):
            os.environ[native.NATIVE_ENV] = flag
            return alti.alti_map(probs, projected, residual, output, valid, causal=True)

        run("1"), run("0")  # warm-up: the builds and the compilation
        best = {"native": float("inf"), "torch.compile": float("inf")}
        maps = {}
        for _ in range(args.repeats):  # interleaved
            for name, flag in (("native", "1"), ("torch.compile", "0")):
                s, maps[name] = timed(lambda: run(flag), 1)
                best[name] = min(best[name], s)
        units = t * (t + 1) / 2 * args.width
        diff = float((maps["native"] - maps["torch.compile"]).abs().max() / maps["torch.compile"].abs().max())
        row = {"tokens": t, "native_s": best["native"], "compile_s": best["torch.compile"],
               "native_ns_per_unit": best["native"] / units * 1e9, "compile_ns_per_unit": best["torch.compile"] / units * 1e9,
               "speedup": best["torch.compile"] / best["native"], "max_rel_diff": diff}
        rows.append(row)
        print(f"T={t}: native {row['native_s']:.3f} s ({row['native_ns_per_unit']:.3f} ns/unit), torch.compile "
              f"{row['compile_s']:.3f} s ({row['compile_ns_per_unit']:.3f} ns/unit), x{row['speedup']:.2f}, "
              f"max rel diff {diff:.1e}", flush=True)
    os.environ.pop(native.NATIVE_ENV, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "heads": args.heads, "width": args.width, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
