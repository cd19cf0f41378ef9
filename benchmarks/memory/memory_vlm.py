r"""Peak extra memory of explaining a vision-language model's prompt, against the decoder's depth.

Usage (from the repository root):
    nice -n 10 python benchmarks/memory/memory_vlm.py [--layers 2 4 8] [--width 256] [--new-tokens 8]
        [--json benchmarks/results/memory_vlm_depth.json]

Model: the LLaVA-1.5-shaped ``LlavaForConditionalGeneration`` of
``benchmarks/speed/vlm_vs_feature_ablation.py`` (random weights, seed 0, float32; a 336 x 336 CLIP tower of
one layer with 14-pixel patches, so 576 image tokens; a Llama decoder of ``--width`` with ``--layers``
layers), prompt = BOS + 576 image tokens + 63 text tokens, and ``--new-tokens`` targets appended
(teacher-forced): every figure explains all of them in one call of ``explain_positions`` (the pass
``DecompositionLLMAttribution`` runs for a generated continuation), ``pixel_values`` by keyword, so the
figure is the cost of the language model's decomposition over the merged sequence, the quantity that must
stay flat in depth.

Every figure is a fresh child process (``_bench.run_child``), 1 torch thread, niceness >= 10: peak
extra memory = resident-set growth over the loaded model and inputs during one (cold) call, polled every
2 ms (``_bench.measure_peak``), with the call's wall time. Methods: the plain forward, ALTI-Logit
and DecompX (both explaining the ``--new-tokens`` targets at their positions).
The last line printed is the JSON of every record (also written to ``--json``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
sys.path[:0] = [BENCHMARKS, os.path.join(BENCHMARKS, "speed")]

from _bench import measure_peak, print_json, run_child  # noqa: E402
from vlm_vs_feature_ablation import IMAGE_TOKEN, PATCH, SIDE, build  # noqa: E402

METHODS = ("forward", "alti_logit", "decompx")


def inputs(new_tokens: int):
    g = torch.Generator().manual_seed(1)
    text = torch.randint(4, 250, (63,), generator=g)
    target = torch.randint(4, 250, (new_tokens,), generator=g)
    ids = torch.cat([torch.tensor([1]), torch.full(((SIDE // PATCH) ** 2,), IMAGE_TOKEN), text, target])[None]
    pixels = torch.randn(1, 3, SIDE, SIDE, generator=g)
    prompt = ids.shape[1] - new_tokens
    positions = torch.arange(prompt - 1, ids.shape[1] - 1)
    return ids, pixels, positions, target


def child(args) -> None:
    if os.nice(0) < 10:
        os.nice(10 - os.nice(0))
    torch.set_num_threads(1)
    from captum_normattr import ALTILogitAttribution, DecompXAttribution

    model = build(args.width, args._layers)
    ids, pixels, positions, target = inputs(args.new_tokens)
    mask = torch.ones_like(ids)
    if args._child == "forward":
        def fn():
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    else:
        method = (ALTILogitAttribution if args._child == "alti_logit" else DecompXAttribution)(model)

        extra = {"attention_mask": mask, "pixel_values": pixels}

        def fn():
            return method.explain_positions(ids, positions, target, additional_forward_args=extra)
    extra_mb, seconds = measure_peak(fn)
    print_json({"method": args._child, "layers": args._layers, "tokens": int(ids.shape[1]),
                "targets": args.new_tokens, "width": args.width, "threads": torch.get_num_threads(),
                "extra_peak_mb": extra_mb, "seconds": seconds})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_layers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(args)
        return
    records = []
    for layers in args.layers:
        for name in METHODS:
            argv = ["--_child", name, "--_layers", layers, "--width", args.width, "--new-tokens", args.new_tokens]
            t0 = time.perf_counter()
            r = run_child(__file__, argv, what=f"{name}, {layers} layers")
            r["child_wall_s"] = time.perf_counter() - t0
            records.append(r)
            print(f"  {name:<10} {layers} layers: {r['extra_peak_mb']:8.1f} MB  {r['seconds']:6.2f} s", flush=True)
    out = {"records": records, "argv": sys.argv[1:]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
