r"""Speed and memory of GlobEnc (N_ENC) and ALTI against one plain forward pass, on MiniLM.

Usage:
    python benchmarks/speed_core.py [--batch 32] [--tokens 128] [--repeats 3] [--long 512]

Prints median times, the ratios to the forward pass measured side by side in the same
run (interleaved repeats), and the peak extra memory of one call at --long tokens: the
resident-set growth over the loaded model, polled every 2 ms in a fresh subprocess per
method.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def _setup(batch: int, tokens: int):
    from captum_normattr import load_default_model

    model, _ = load_default_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (batch, tokens), generator=g)
    ids[:, 0] = 101
    mask = torch.ones_like(ids)
    return model, ids, mask


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
    times = {n: [] for n in runs}
    with torch.no_grad():
        for fn in runs.values():
            fn(ids, mask)  # warm-up
        for _ in range(repeats):  # interleaved, so noise hits all alike
            for n, fn in runs.items():
                t0 = time.perf_counter()
                fn(ids, mask)
                times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"batch": batch, "tokens": tokens, "seconds": med,
            "ratio_globenc": med["globenc"] / med["forward"], "ratio_alti": med["alti"] / med["forward"]}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_memory_child(name: str, tokens: int) -> None:
    import gc
    import threading

    model, ids, mask = _setup(1, tokens)
    fn = _runner(name, model)
    gc.collect()
    base = _rss_mb()
    peak = [base]
    done = threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            done.wait(0.002)

    th = threading.Thread(target=poll)
    th.start()
    with torch.no_grad():
        fn(ids, mask)
    done.set()
    th.join()
    print(json.dumps({"method": name, "extra_peak_mb": peak[0] - base}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long", type=int, default=512)
    p.add_argument("--_memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child:
        peak_memory_child(args._memory_child, args.long)
        return
    torch.manual_seed(0)
    res = time_methods(args.batch, args.tokens, args.repeats)
    s = res["seconds"]
    print(f"MiniLM, batch {args.batch} x {args.tokens} tokens, median of {args.repeats} (torch threads {torch.get_num_threads()})")
    print(f"  forward  {s['forward']:.3f} s")
    print(f"  GlobEnc  {s['globenc']:.3f} s  = {res['ratio_globenc']:.2f} x forward (target <= 2)")
    print(f"  ALTI     {s['alti']:.3f} s  = {res['ratio_alti']:.2f} x forward (target <= 4)")
    print(f"peak extra memory (RSS growth over the loaded model, polled) at 1 x {args.long} tokens:")
    for name in ("forward", "globenc", "alti"):
        out = subprocess.run([sys.executable, __file__, "--_memory_child", name, "--long", str(args.long)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        print(f"  {name:<8} {json.loads(out)['extra_peak_mb']:.0f} MB")


if __name__ == "__main__":
    main()
