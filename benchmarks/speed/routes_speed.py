r"""Information-flow routes of one prediction vs ALTI-Logit for that prediction (target: <= 2x).

Usage:
    nice python benchmarks/speed/routes_speed.py [--tokens 1024] [--layers 6] [--thresholds 0.04 0.005]
                                           [--repeats 2] [--threads 2]

Config: the ~100M Llama-family model of the decoder benchmarks (hidden 768, 12 heads, 4
key/value heads, SwiGLU 2048, float32, random weights; :data:`_bench.LLAMA_100M`) with
``--layers`` layers, batch 1, ``--tokens`` tokens. Timed side by side in this process (one
warm-up call each, then the minimum of ``--repeats`` interleaved calls): a plain forward pass
(sdpa), ALTI-Logit of token 42 at the last position (the tied embedding as unembedding) and
the whole route graph at the last position for every threshold (one recorded forward pass,
then every layer rerun top-down from its checkpoint and the per-head parts of the kept rows
only). Prints one JSON line: seconds, the ratios routes / ALTI-Logit, and each graph's size
(nodes, edges, kept rows per layer), the per-layer cost of K kept rows with either kernel
(:func:`kept_rows_cost`) and the machine's load average (timings on a shared machine are noisy).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)

from _bench import LLAMA_100M, decoder_runner, llama_model, print_json, random_ids, time_interleaved  # noqa: E402


def kept_rows_cost(model, ids, counts) -> dict:
    r"""Seconds of the per-head importances of K kept rows (the last K positions) on the first layer.

    Random weights attend almost uniformly, so their graphs keep few rows; a trained model at
    a low threshold keeps more. This prices them: the routes cost = recorded forward + one
    rerun per layer + this per layer. Eager and compiled kernels (the compiled one is bought
    by default once the eager one has cost 10 s in a process; its warm-up includes the compilation).
    """
    import time

    from captum_normattr.models.engine import streamed_forward
    from captum_normattr.attr.inputs import prepare_inputs
    from captum_normattr.decompose.methods.routes import attention_edge_importances
    from captum_normattr.models.adapters import get_adapter

    adapter = get_adapter(model)
    prepared = prepare_inputs(model, adapter, ids)
    got = {}

    def on_layer(layer):
        if layer.index == 0:
            got["layer"] = layer

    with streamed_forward(model, adapter, prepared, on_layer):
        pass
    from captum_normattr.decompose.primitives.compiled import use_compiled_kernels

    layer, t = got["layer"], ids.shape[1]
    out = {}
    try:
        for kernel, setting in (("eager", False), ("compiled", True)):
            use_compiled_kernels(setting)
            t0 = time.perf_counter()
            for k in (1, 2):  # warm-up: compiles once for one row, once for several (torch specialises size 1)
                attention_edge_importances(layer, torch.arange(t - k, t), prepared.valid)
            out[f"{kernel}_warm_up"] = round(time.perf_counter() - t0, 3)
            for k in counts:
                rows = torch.arange(t - k, t)
                best = float("inf")
                for _ in range(2):  # the minimum of two calls
                    t0 = time.perf_counter()
                    attention_edge_importances(layer, rows, prepared.valid)
                    best = min(best, time.perf_counter() - t0)
                out[f"{kernel}_{k}"] = round(best, 3)
    finally:
        use_compiled_kernels(None)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.04, 0.005])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64],
                   help="numbers of kept rows whose per-head importances are timed on one layer")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from captum_normattr.attr.routes import InformationFlowRoutes

    model = llama_model(LLAMA_100M, layers=args.layers)
    ids = random_ids(1, args.tokens, low=100, high=30000, cls=None)
    routes = InformationFlowRoutes(model)
    graphs = {}

    def route_run(tau):
        def run(x):
            graphs[tau] = routes.attribute(x, threshold=tau)
        return run

    runs = {"forward": decoder_runner("forward", model), "alti_logit": decoder_runner("alti_logit", model)}
    for tau in args.thresholds:
        runs[f"routes_{tau:g}"] = route_run(tau)
    sec = time_interleaved(runs, (ids,), args.repeats, stat="min")
    out = {
        "benchmark": "routes_speed", "tokens": args.tokens, "layers": args.layers, "threads": args.threads,
        "repeats": args.repeats, "seconds": {k: round(v, 3) for k, v in sec.items()},
        "ratio_to_alti_logit": {k: round(v / sec["alti_logit"], 3) for k, v in sec.items() if k.startswith("routes")},
        "graphs": {f"{tau:g}": {"nodes": len(g.nodes), "edges": len(g.edges), "head_edges": sum(e["kind"] == "head" for e in g.edges),
                                "rows_per_layer": g.meta["rows_per_layer"]} for tau, g in graphs.items()},
        "goal": "routes <= 2x ALTI-Logit",
        "kept_rows_seconds_per_layer": kept_rows_cost(model, ids, args.rows),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print_json(out)
    return out


if __name__ == "__main__":
    main()
