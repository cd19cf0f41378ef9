r"""Where DecompX's time goes on the ~100M Llama config (the adjoint algorithm, a decoder).

Usage:
    python benchmarks/speed/profile_decompx.py [--tokens 1024] [--repeats 3] [--threads 2] [--nodes 48 16]

Times (wall, min over ``--repeats`` interleaved calls after a warm-up) one plain forward
pass (sdpa) and ``DecompXAttribution.decompose`` on the next-token logit (the call of
``speed_decoder.py``), once per ``--nodes`` value (Gauss-Legendre nodes of the SwiGLU gate
integrals; 48 is the default), and splits the DecompX call with timers wrapped around its
functions. Every timer counts its exclusive time (a timed function called inside another
one is subtracted from the outer one):

- recording forward: the rest of the call (the model's forward pass with the recording
  attention and hooks, the final norm, the scores);
- gate integrals: ``gate_integrals`` (closed form for the SiLU gate with the default 48
  nodes, the quadrature loop with its per-node autograd otherwise), in the forward phase
  (the forward algorithm, or the adjoint's last layer when it is kept) and in the backward phase;
- FF coefficients (rest): the products u W_in, u W_gate and the quadrature error;
- checkpoints (forward phase): ``AdjointPass.forward``;
- rerun real layer: ``Recorder.rerun_layer`` (the real layer again, on its checkpoint);
- VJP: ``FrozenLayer.vjp``, the written-out transpose of the frozen layer (backward phase);
- layer constants: ``FrozenLayer.constant`` (0 without biases: Llama);
- backward phase, rest: the rest of ``AdjointPass.backward``.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))  # measure the checkout this script lives in
sys.path.insert(0, str(BENCHMARKS))

from _bench import random_ids  # noqa: E402

TIMES: dict = defaultdict(float)
STACK: list = []  # [label, seconds spent in timed children]
PHASE = {"backward": False}


def _timed(fn, label):
    def run(*a, **k):
        lab = label(a) if callable(label) else label
        if lab is None or (STACK and STACK[-1][0].startswith("gate integrals")):
            return fn(*a, **k)
        STACK.append([lab, 0.0])
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            _, child = STACK.pop()
            TIMES[lab] += dt - child
            if STACK:
                STACK[-1][1] += dt

    return run


def instrument() -> None:
    from captum_normattr.decompose.methods.decompx import adjoint as dd
    from captum_normattr.decompose.methods.decompx import parts as dp
    from captum_normattr.models.capture import recorder as capture

    phase = lambda: "backward phase" if PHASE["backward"] else "forward phase"
    dp.gate_integrals = _timed(dp.gate_integrals, lambda a: f"gate integrals ({phase()})")
    dp.ff_coefficients = _timed(dp.ff_coefficients, lambda a: f"FF coefficients, rest ({phase()})")
    import captum_normattr.attr.decompx as ad

    ad.ff_coefficients = dp.ff_coefficients
    dd.AdjointPass.forward = _timed(dd.AdjointPass.forward, "checkpoints (forward phase)")
    capture.Recorder.rerun_layer = _timed(capture.Recorder.rerun_layer, "rerun real layer (backward phase)")
    dd.FrozenLayer.vjp = _timed(dd.FrozenLayer.vjp, "VJP, written out (backward phase)")
    dd.FrozenLayer.constant = _timed(dd.FrozenLayer.constant, "layer constants (backward phase)")
    inner = _timed(dd.AdjointPass.backward, "backward phase, rest")

    def backward(*a, **k):
        PHASE["backward"] = True
        try:
            return inner(*a, **k)
        finally:
            PHASE["backward"] = False

    dd.AdjointPass.backward = backward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--nodes", type=int, nargs="+", default=[48])
    p.add_argument("--no-split", action="store_true", help="only total times (no timers)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from captum_normattr import DecompXAttribution
    from speed_decoder import _model

    if not args.no_split:
        instrument()
    model = _model()
    ids = random_ids(1, args.tokens, low=100, high=30000, cls=None)
    runs = {"forward": lambda: model(input_ids=ids, use_cache=False)}
    deltas = {}
    for n in args.nodes:
        d = DecompXAttribution(model, unembedding=model.embed_tokens.weight, nodes=n)
        runs[f"decompx nodes={n}"] = (lambda d=d: d.decompose(ids, target=42))
    best: dict = {}
    split: dict = {}
    with torch.no_grad():
        for name, fn in runs.items():
            fn()
        for _ in range(args.repeats):
            for name, fn in runs.items():
                TIMES.clear()
                t0 = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t0
                if name != "forward":
                    deltas[name] = (float(out.delta.max()), float(out.extras["quadrature_error"].max()))
                if dt < best.get(name, float("inf")):
                    best[name], split[name] = dt, dict(TIMES)
    fwd = best["forward"]
    print(f"Llama ~100M, 1 x {args.tokens}, {args.threads} threads, min of {args.repeats}; forward (sdpa) {fwd:.3f} s")
    for name in runs:
        if name == "forward":
            continue
        s = split[name]
        print(f"\n{name}: {best[name]:.2f} s ({best[name] / fwd:.1f}x the forward); "
              f"max |delta| {deltas[name][0]:.2e}, max quadrature error {deltas[name][1]:.2e}")
        if s:
            print("| part | seconds | share |\n|---|---:|---:|")
            rest = best[name] - sum(s.values())
            for lab, sec in sorted(list(s.items()) + [("recording forward and rest", rest)], key=lambda kv: -kv[1]):
                print(f"| {lab} | {sec:.2f} | {100 * sec / best[name]:.0f}% |")


if __name__ == "__main__":
    main()
