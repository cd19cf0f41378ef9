r"""Where the time of a decomposition call goes: recording forward, maps, completeness, rollout.

Usage:
    python benchmarks/speed/speed_profile.py [--workload minilm|llama] [--methods globenc alti ...] [--repeats 3] [--threads 2]

Times (wall, min over ``--repeats`` calls after a warm-up) one plain forward pass and each
method, and splits each method's call with timers wrapped around the engine's functions:
the per-layer maps, the completeness check, the finiteness check, the cast of the recorded
tensors (``layer_tensors``), the rollout; "recording forward" is the rest of the call
(the model's own forward with the recording attention and hooks).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
if "--package" in sys.argv:  # measure another checkout (e.g. an export of main), before anything is imported
    sys.path.insert(0, sys.argv[sys.argv.index("--package") + 1])
else:
    sys.path.insert(0, str(BENCHMARKS.parent))
sys.path.insert(0, str(BENCHMARKS))

from _bench import random_ids  # noqa: E402

TIMES: dict = defaultdict(float)


def _wrap(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def instrument() -> None:
    from captum_normattr.models import engine
    from captum_normattr.decompose.kinds import registry as layer_kinds
    from captum_normattr.decompose.primitives import rollout
    from captum_normattr.models.capture import attention
    from captum_normattr.models.capture import recorder as capture

    for kind in layer_kinds.LAYER_KINDS.values():
        _wrap(kind, "norm_maps", "maps")
        _wrap(kind, "alti_map", "maps")
        _wrap(kind, "completeness_error", "completeness")
    _wrap(engine, "layer_finite", "finite check")
    _wrap(capture.Recorder, "layer_tensors", "cast records")
    _wrap(attention, "_eager_attention", "eager attention")
    _wrap(rollout.LayerMapStore, "rollout_rows", "rollout")
    _wrap(rollout.LayerMapStore, "put", "rollout")
    try:
        from captum_normattr.attr import decompx as dx

        for n in ("DecompXAttribution",):
            cls = getattr(dx, n)
            for m in ("_adjoint", "_layer_pass"):
                if hasattr(cls, m):
                    _wrap(cls, m, "decompx " + m)
    except ImportError:
        pass


def setup(workload: str):
    if workload == "minilm":
        from captum_normattr import load_default_model

        model, _ = load_default_model()
        ids = random_ids(32, 128)
        return model, ids, torch.ones_like(ids), model.config._attn_implementation
    from speed_decoder import _model

    model = _model()
    ids = random_ids(1, 1024, low=100, high=30000, cls=None)
    return model, ids, torch.ones_like(ids), "sdpa"


def runner(name: str, model, decoder: bool):
    import captum_normattr as cn

    if name == "forward":
        kw = {"use_cache": False} if decoder else {}
        return lambda ids, mask: model(input_ids=ids, attention_mask=mask, **kw)
    if name == "globenc":
        a = cn.GlobEncAttribution(model) if decoder else cn.GlobEncAttribution(model, "N_ENC")
        return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))
    if name == "alti":
        a = cn.ALTIAttribution(model)
        return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))
    if name == "alti_logit":
        a = cn.ALTILogitAttribution(model, unembedding=model.embed_tokens.weight)
        return lambda ids, mask: a.attribute(ids, target=42, additional_forward_args=(mask,))
    if name == "decompx":
        a = cn.DecompXAttribution(model, unembedding=model.embed_tokens.weight)
        return lambda ids, mask: a.attribute(ids, target=42, additional_forward_args=(mask,))
    raise ValueError(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("minilm", "llama"), default="minilm")
    p.add_argument("--methods", nargs="+", default=["globenc", "alti"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-split", action="store_true", help="only total times (no timers)")
    p.add_argument("--package", default=None, help="folder holding the captum_normattr to measure (default: this checkout)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, ids, mask, impl = setup(args.workload)
    decoder = args.workload == "llama"
    if not args.no_split:
        instrument()
    runs = {n: runner(n, model, decoder) for n in ["forward"] + args.methods}
    best: dict = {}
    split: dict = {}
    with torch.no_grad():
        for n, fn in runs.items():
            fn(ids, mask)
        for _ in range(args.repeats):
            for n, fn in runs.items():
                TIMES.clear()
                t0 = time.perf_counter()
                fn(ids, mask)
                dt = time.perf_counter() - t0
                if dt < best.get(n, float("inf")):
                    best[n], split[n] = dt, dict(TIMES)
    fwd = best["forward"]
    import captum_normattr

    print(f"package {Path(captum_normattr.__file__).parent.parent.name}")
    print(f"{args.workload}: {tuple(ids.shape)}, {args.threads} threads, min of {args.repeats}; forward ({impl}) {fwd:.3f} s")
    for n in args.methods:
        s = split[n]
        parts = {k: v for k, v in s.items() if k != "eager attention"}
        inner = sum(parts.values())
        print(f"  {n:<10} {best[n]:.3f} s = {best[n] / fwd:.2f}x  recording forward {best[n] - inner:.3f} "
              f"(eager attention {s.get('eager attention', 0):.3f}) " + " ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items())))


if __name__ == "__main__":
    main()
