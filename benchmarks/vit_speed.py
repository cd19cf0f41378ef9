r"""Speed of every method on a ViT-B/16-sized classifier, as ratios to its forward pass.

Usage:
    python benchmarks/vit_speed.py [--batch 16] [--size 224] [--repeats 3] [--threads N] [--methods ...]

The model is ``ViTForImageClassification`` with the ViT-B/16 configuration (12 layers,
width 768, 12 heads, FF 3072, patch 16, 1000 classes; 197 tokens at 224 x 224) and random
weights, float32. Each method is timed on the same random batch, interleaved with the
forward pass of the classifier (``_bench.time_interleaved``: warm-up, then the median of
``--repeats`` rounds), so that machine noise hits all alike; the ratio is method time /
forward time. Captum's gradient methods are included for reference (IG with 32 steps).
Prints one JSON line with the times and ratios.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from captum.attr import InputXGradient, IntegratedGradients, Saliency  # noqa: E402
from transformers import ViTConfig, ViTForImageClassification  # noqa: E402

from captum_normattr import ALTIAttribution, DecompXAttribution, FFIntegratedDecomposition, GlobEncAttribution  # noqa: E402


def build(size: int) -> ViTForImageClassification:
    cfg = ViTConfig(image_size=size, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, num_labels=1000)
    torch.manual_seed(0)
    return ViTForImageClassification(cfg).eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument(
        "--methods", nargs="*",
        default=["GlobEnc", "ALTI", "GlobEnc+FF", "DecompX", "Saliency", "InputXGradient", "IntegratedGradients"],
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.size)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(1))
    fwd = lambda px: model(pixel_values=px).logits
    target = torch.zeros(args.batch, dtype=torch.long)
    calls = {
        "GlobEnc": lambda: GlobEncAttribution(model).attribute(x),
        "ALTI": lambda: ALTIAttribution(model).attribute(x),
        "GlobEnc+FF": lambda: FFIntegratedDecomposition(model).attribute(x),
        "DecompX": lambda: DecompXAttribution(model).attribute(x, target=target),
        "DecompX (forward algorithm)": lambda: DecompXAttribution(model, algorithm="forward").attribute(x, target=target),
        "Saliency": lambda: Saliency(fwd).attribute(x, target=target),
        "InputXGradient": lambda: InputXGradient(fwd).attribute(x, target=target),
        "IntegratedGradients": lambda: IntegratedGradients(fwd).attribute(
            x, target=target, n_steps=32, internal_batch_size=args.batch
        ),
    }

    def forward():
        with torch.no_grad():
            fwd(x)

    def clock(f):
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    forward()  # warm-up
    out = {"batch": args.batch, "size": args.size, "threads": torch.get_num_threads(), "forward_s": None, "methods": {}}
    fwd_times = []
    for name in args.methods:
        calls[name]()  # warm-up
        ts, fs = [], []
        for _ in range(args.repeats):  # interleaved with the forward pass
            fs.append(clock(forward))
            ts.append(clock(calls[name]))
        fs.sort(), ts.sort()
        f_med, t_med = fs[len(fs) // 2], ts[len(ts) // 2]
        fwd_times.append(f_med)
        out["methods"][name] = {"seconds": t_med, "forward_seconds": f_med, "ratio": t_med / f_med}
        print(f"{name:28s} {t_med:8.2f} s  forward {f_med:6.2f} s  ratio {t_med / f_med:6.1f}", flush=True)
    out["forward_s"] = sorted(fwd_times)[len(fwd_times) // 2]
    import json

    print(json.dumps(out))


if __name__ == "__main__":
    main()
