r"""Speed of every method on a ViT-B/16-sized classifier, as ratios to its forward pass.

Usage:
    python benchmarks/speed/vit_speed.py [--batch 16] [--small-batch 1] [--small-methods ...] [--size 224]
                                   [--repeats 1] [--threads 1] [--out benchmarks/results/vit_speed.json]

The model is ``ViTForImageClassification`` with the ViT-B/16 configuration (12 layers,
width 768, 12 heads, FF 3072, patch 16, 1000 classes; 197 tokens at 224 x 224) and random
weights, float32. Every method runs on the same random batch; each call is timed between
two forward passes of the classifier on the same batch (``--repeats`` rounds, median), and
the ratio is the method's time over the mean of the forward passes next to it, so that
machine noise hits both alike. Both the wall time and the CPU time of the process are
recorded; on a shared machine the CPU-time ratio (one torch thread) is the reliable one.

Methods whose cost is many forward passes (``--small-methods``: GlobEnc+FF, ALTI+FF, the FF scope
(not run by default: every scope costs what GlobEnc+FF costs) and IntegratedGradients, Captum's
default 50 steps) are timed at ``--small-batch`` instead
of ``--batch`` (with the forward pass at that batch): every row of the output says its
batch. ALTI+FF is ``FFIntegratedDecomposition(contribution="alti")``.
Writes the JSON to ``--out`` and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))

from captum.attr import InputXGradient, IntegratedGradients, Saliency  # noqa: E402
from transformers import ViTConfig, ViTForImageClassification  # noqa: E402

from captum_normattr import ALTIAttribution, DecompXAttribution, FFIntegratedDecomposition, GlobEncAttribution  # noqa: E402

ALL = ["GlobEnc", "ALTI", "DecompX", "Saliency", "InputXGradient", "GlobEnc+FF", "ALTI+FF", "FF decomposition (FF scope)",
       "IntegratedGradients"]
SMALL = ["FF decomposition (FF scope)", "GlobEnc+FF", "ALTI+FF", "IntegratedGradients"]
DEFAULT = [m for m in ALL if m != "FF decomposition (FF scope)"]  # every scope costs what GlobEnc+FF costs


def build(size: int) -> ViTForImageClassification:
    cfg = ViTConfig(image_size=size, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, num_labels=1000)
    torch.manual_seed(0)
    return ViTForImageClassification(cfg).eval()


def calls(model, x, interpolate: bool = False):
    fwd = lambda px: model(pixel_values=px, interpolate_pos_encoding=interpolate).logits
    target = torch.zeros(len(x), dtype=torch.long)
    return {
        "GlobEnc": lambda: GlobEncAttribution(model).attribute(x),
        "ALTI": lambda: ALTIAttribution(model).attribute(x),
        "DecompX": lambda: DecompXAttribution(model).attribute(x, target=target),
        "FF decomposition (FF scope)": lambda: FFIntegratedDecomposition(model, scope="FF").attribute(x),
        "GlobEnc+FF": lambda: FFIntegratedDecomposition(model).attribute(x),
        "ALTI+FF": lambda: FFIntegratedDecomposition(model, contribution="alti").attribute(x),
        "Saliency": lambda: Saliency(fwd).attribute(x, target=target),
        "InputXGradient": lambda: InputXGradient(fwd).attribute(x, target=target),
        "IntegratedGradients": lambda: IntegratedGradients(fwd).attribute(x, target=target, internal_batch_size=len(x)),
    }


def clock(f):
    w0, c0 = time.perf_counter(), time.process_time()
    f()
    return time.perf_counter() - w0, time.process_time() - c0


def measure(model, batch: int, size: int, names, repeats: int, warm: bool, on_row=None):
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    fns = calls(model, x)

    def forward():
        with torch.no_grad():
            model(pixel_values=x)

    forward()  # warm-up
    # each method's warm-up call on one small image (32 x 32, interpolated positions): the
    # code paths run once without costing a full call
    tiny = calls(model, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)), interpolate=True)
    out = {}
    for name in names:
        if warm:
            tiny[name]()
        rounds = []
        for _ in range(repeats):
            f0 = clock(forward)
            m = clock(fns[name])
            f1 = clock(forward)
            rounds.append((m, ((f0[0] + f1[0]) / 2, (f0[1] + f1[1]) / 2)))
        med = lambda key: statistics.median(key(r) for r in rounds)
        row = {
            "batch": batch,
            "seconds": med(lambda r: r[0][0]), "cpu_seconds": med(lambda r: r[0][1]),
            "forward_seconds": med(lambda r: r[1][0]), "forward_cpu_seconds": med(lambda r: r[1][1]),
            "ratio_wall": med(lambda r: r[0][0] / r[1][0]), "ratio_cpu": med(lambda r: r[0][1] / r[1][1]),
            "repeats": repeats,
        }
        out[name] = row
        if on_row is not None:
            on_row(name, row)
        print(f"{name:28s} batch {batch:3d}  {row['cpu_seconds']:8.2f} s CPU  forward {row['forward_cpu_seconds']:6.2f} s CPU  "
              f"ratio {row['ratio_cpu']:6.1f} (wall {row['ratio_wall']:6.1f})", flush=True)
    return out


def table(results) -> str:
    rows = ["| method | batch | CPU s | forward CPU s | ratio (CPU time) | ratio (wall time) |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results["methods"].items():
        rows.append(f"| {name} | {r['batch']} | {r['cpu_seconds']:.2f} | {r['forward_cpu_seconds']:.2f} | "
                    f"{r['ratio_cpu']:.1f} | {r['ratio_wall']:.1f} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--small-batch", type=int, default=1)
    ap.add_argument("--small-methods", nargs="*", default=SMALL, help="methods timed at --small-batch")
    ap.add_argument("--methods", nargs="*", default=DEFAULT)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave the default)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed first call of each method (on a 32 x 32 image)")
    ap.add_argument("--out", default=str(BENCHMARKS / "results" / "vit_speed.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    unknown = set(args.methods) - set(ALL)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {ALL}")
    model = build(args.size)
    results = {"size": args.size, "threads": torch.get_num_threads(), "model": "ViT-B/16 configuration, random weights, float32",
               "methods": {}}
    big = [m for m in args.methods if m not in args.small_methods]
    small = [m for m in args.methods if m in args.small_methods]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save(name, row):  # after every method, so that a stopped run keeps what it measured
        results["methods"][name] = row
        Path(args.out).write_text(json.dumps(results, indent=1))

    if big:
        measure(model, args.batch, args.size, big, args.repeats, not args.no_warmup, save)
    if small:
        measure(model, args.small_batch, args.size, small, args.repeats, not args.no_warmup, save)
    results["methods"] = {m: results["methods"][m] for m in args.methods}
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
