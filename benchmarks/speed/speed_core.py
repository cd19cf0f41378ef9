r"""Speed and memory of GlobEnc (N_ENC) and ALTI against one plain forward pass, on MiniLM.

Usage:
    python benchmarks/speed/speed_core.py [--batch 32] [--tokens 128] [--repeats 3] [--threads 2] [--long 512]

Prints the minimum wall times over the repeats (2 torch threads by default), the ratios to
the plain forward pass of the same model (its default attention, sdpa) measured side by
side in the same process (interleaved repeats after one warm-up call each), and the peak extra memory of one call at --long tokens: the
resident-set growth over the loaded model, polled every 2 ms in a fresh subprocess per
method.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))  # measure the checkout this script lives in
sys.path.insert(0, str(BENCHMARKS))

from _bench import measure_peak, print_json, random_ids, run_child, time_interleaved  # noqa: E402


def _setup(batch: int, tokens: int):
    from captum_normattr import load_default_model

    model, _ = load_default_model()
    ids = random_ids(batch, tokens)
    return model, ids, torch.ones_like(ids)


def _runner(name: str, model):
    from captum_normattr import ALTIAttribution, GlobEncAttribution

    if name == "forward":
        return lambda ids, mask: model(input_ids=ids, attention_mask=mask)
    if name == "globenc":
        a = GlobEncAttribution(model, "N_ENC")
        return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))
    if name == "alti":
        a = ALTIAttribution(model)
        return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))
    raise ValueError(name)


def time_methods(batch: int, tokens: int, repeats: int) -> dict:
    model, ids, mask = _setup(batch, tokens)
    runs = {n: _runner(n, model) for n in ("forward", "globenc", "alti")}
    med = time_interleaved(runs, (ids, mask), repeats, stat="min")
    return {"batch": batch, "tokens": tokens, "seconds": med,
            "ratio_globenc": med["globenc"] / med["forward"], "ratio_alti": med["alti"] / med["forward"]}


def peak_memory_child(name: str, tokens: int) -> None:
    model, ids, mask = _setup(1, tokens)
    extra_mb, seconds = measure_peak(_runner(name, model), ids, mask)
    print_json({"method": name, "extra_peak_mb": extra_mb, "seconds": seconds})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--_memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child:
        peak_memory_child(args._memory_child, args.long)
        return
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    res = time_methods(args.batch, args.tokens, args.repeats)
    s = res["seconds"]
    print(f"MiniLM, batch {args.batch} x {args.tokens} tokens, min of {args.repeats} (torch threads {torch.get_num_threads()})")
    print(f"  forward  {s['forward']:.3f} s")
    print(f"  GlobEnc  {s['globenc']:.3f} s  = {res['ratio_globenc']:.2f} x forward (goal <= 1.3)")
    print(f"  ALTI     {s['alti']:.3f} s  = {res['ratio_alti']:.2f} x forward (goal <= 2.5)")
    print(f"peak extra memory (RSS growth over the loaded model, polled) at 1 x {args.long} tokens:")
    for name in ("forward", "globenc", "alti"):
        r = run_child(__file__, ["--_memory_child", name, "--long", str(args.long)])
        print(f"  {name:<8} {r['extra_peak_mb']:.0f} MB")


if __name__ == "__main__":
    main()
