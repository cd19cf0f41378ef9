r"""Speed and memory of the FF decomposition (GlobEnc+FF) on MiniLM: closed form vs numerical IG vs forward.

Usage:
    python benchmarks/speed_ff.py [--batch 2] [--tokens 64 128] [--repeats 3] [--long 512]

For every token length, times one plain forward pass, ``FFIntegratedDecomposition`` with the
exact closed form (the default) and with ``method="riemann", steps=50`` (midpoint-rule IG by
autograd), interleaved in one run so that noise hits all alike, and prints medians and the
ratios to the forward pass. Then the peak extra memory of one call on 1 example: the
resident-set growth over the loaded model, polled every 2 ms in a fresh subprocess per
(method, length), at every --tokens length and, for the closed form with its default memory
budget, at --long tokens.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # measure the checkout this script lives in
sys.path.insert(0, str(HERE))

from _bench import measure_peak, print_json, random_ids, run_child, time_interleaved  # noqa: E402

METHODS = ("forward", "closed_form", "riemann50")


def _setup(batch: int, tokens: int):
    from captum_normattr import load_default_model

    model, _ = load_default_model()
    ids = random_ids(batch, tokens, sep=102)
    return model, ids, torch.ones_like(ids)


def _runner(name: str, model):
    from captum_normattr import FFIntegratedDecomposition

    if name == "forward":
        return lambda ids, mask: model(input_ids=ids, attention_mask=mask)
    if name == "closed_form":
        a = FFIntegratedDecomposition(model)
    elif name == "riemann50":
        a = FFIntegratedDecomposition(model, method="riemann", steps=50)
    else:
        raise ValueError(name)
    return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))


def time_methods(batch: int, tokens: int, repeats: int) -> dict:
    model, ids, mask = _setup(batch, tokens)
    runs = {n: _runner(n, model) for n in METHODS}
    return {"batch": batch, "tokens": tokens, "seconds": time_interleaved(runs, (ids, mask), repeats)}


def peak_memory_child(name: str, tokens: int) -> None:
    model, ids, mask = _setup(1, tokens)
    extra_mb, seconds = measure_peak(_runner(name, model), ids, mask)
    print_json({"method": name, "tokens": tokens, "extra_peak_mb": extra_mb, "seconds": seconds})


def _child(name: str, tokens: int) -> dict:
    return run_child(__file__, ["--_memory_child", name, "--long", str(tokens)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long", type=int, default=512, help="closed-form memory check at this length (0: skip)")
    p.add_argument("--_memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child:
        peak_memory_child(args._memory_child, args.long)
        return
    torch.manual_seed(0)
    print(f"MiniLM (6 layers, D 384, FF 1536), FFIntegratedDecomposition (GlobEnc+FF, norm contribution), "
          f"torch threads {torch.get_num_threads()}")
    print("| tokens | batch | forward (s) | closed form (s) | IG 50 steps (s) | closed / forward | IG50 / forward | IG50 / closed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in args.tokens:
        s = time_methods(args.batch, t, args.repeats)["seconds"]
        print(f"| {t} | {args.batch} | {s['forward']:.4f} | {s['closed_form']:.3f} | {s['riemann50']:.3f} | "
              f"{s['closed_form'] / s['forward']:.0f} | {s['riemann50'] / s['forward']:.0f} | "
              f"{s['riemann50'] / s['closed_form']:.2f} |", flush=True)
    print(f"\npeak extra memory of one call on 1 example (RSS growth over the loaded model, polled every 2 ms; "
          f"default memory_budget_mb=128):")
    print("| tokens | forward (MB) | closed form (MB) | IG 50 steps (MB) |")
    print("|---:|---:|---:|---:|")
    for t in args.tokens:
        r = {n: _child(n, t)["extra_peak_mb"] for n in METHODS}
        print(f"| {t} | {r['forward']:.0f} | {r['closed_form']:.0f} | {r['riemann50']:.0f} |", flush=True)
    if args.long:
        r = _child("closed_form", args.long)
        f = _child("forward", args.long)
        print(f"| {args.long} | {f['extra_peak_mb']:.0f} | {r['extra_peak_mb']:.0f} ({r['seconds']:.1f} s) | not run |")


if __name__ == "__main__":
    main()
