r"""Peak memory of GlobEnc, ALTI, ALTI-Logit and DecompX at Llama-3-8B width, projected to 32 layers and 4096 tokens.

A bare ``LlamaModel`` with the dimensions of Llama-3-8B (hidden 4096, 32 heads, 8 key/value
heads, FF 14336, SwiGLU, RMSNorm) but ``--layers`` layers (1 and 2) and a vocabulary of 1000
(ALTI-Logit and DecompX explain token 42 through ``unembedding=model.embed_tokens.weight``),
random weights (seed 0), float32, sdpa, batch 1, one text of ``--tokens`` tokens.

Every figure comes from a fresh child process (``_bench.run_child``; 1 torch thread,
niceness >= 10): the peak resident-set growth of one ``attribute()`` call over the loaded
model and inputs (``_bench.measure_peak``). From the 1-layer and 2-layer figures:

    per_layer(T) = peak(2 layers) - peak(1 layer)      (what each further layer keeps)
    base(T)      = peak(1 layer) - per_layer(T)         (one layer's working set, alive once)
    peak(L, T)   = base(T) + L * per_layer(T)

and from two lengths T1 < T2 each of base and per_layer is fitted as a T + b T^2 (the
attention probabilities and the maps are T^2; the hidden states, checkpoints and the FF
activations are T), then evaluated at ``--project-tokens`` (4096) and 32 layers.

The CPU model is float32, so the compute dtype costs no copy of the weights; a bfloat16
model on a GPU upcasts one layer's weights to float32 while that layer is decomposed
(``LayerTensors`` holds W_O and the FF weights; DecompX adds W_V): that is added
analytically, twice for DecompX (its adjoint reruns a layer while the next is released).
The projection is for the streaming engine on one GPU; "room left" = 80 GB - 16 GB
(the bfloat16 weights of Llama-3-8B, 8.03e9 parameters) - the projected peak.

Usage (about 20-40 min on a shared 2-core machine; keep an eye on ``free -g``: the 2-layer
model is 1.75 GB of float32 weights and a 2048-token call adds a few GB):

    nice -n 10 python benchmarks/bigmodel_projection.py --tokens 1024 2048 \
        --json benchmarks/results/bigmodel_projection.json
    python benchmarks/bigmodel_projection.py --table benchmarks/results/bigmodel_projection.json

Options: ``--methods globenc alti alti_logit decompx``, ``--tokens T1 T2``, ``--layers 1 2``,
``--project-tokens 4096``, ``--project-layers 32``, ``--limit-gb 12`` (a child aborts past it),
``--timeout`` (seconds per child).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import decoder_runner, llama_model, measure_peak, print_json, random_ids, rss_mb, run_child  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 vocab_size=1000, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
                 rope_theta=500000.0)
PARAMS_8B = 8.03e9
GPU_GB = 80.0
TARGET = 42
EXIT_OVER, EXIT_TIMEOUT = 3, 4
METHODS = ("globenc", "alti", "alti_logit", "decompx")


def layer_weight_gb(decompx: bool) -> float:
    r"""float32 bytes of the weights one LayerTensors holds (W_O, W_up, W_gate, W_down; + W_V for DecompX)."""
    d, f, kv = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], LLAMA3_8B["num_key_value_heads"]
    dh = d // LLAMA3_8B["num_attention_heads"]
    n = d * d + 3 * d * f + (d * kv * dh if decompx else 0)
    return 4 * n / 2**30


def child(args) -> None:
    if os.nice(0) < 10:
        os.nice(10 - os.nice(0))
    torch.set_num_threads(1)
    model = llama_model(LLAMA3_8B, layers=args._layers)
    ids = random_ids(1, args._tokens, low=1, high=1000, cls=None)
    run = decoder_runner(args._child, model, TARGET)
    info: dict = {}
    # DecompX's runner returns its result (decompose(), the computation of attribute() on a decoder):
    # it says which algorithm "auto" chose at this size
    fn = lambda: info.update(algorithm=run(ids).algorithm) if args._child == "decompx" else run(ids)  # noqa: E731
    record = {"method": args._child, "layers": args._layers, "tokens": args._tokens, "model_rss_mb": rss_mb()}

    def abort(extra_mb: float) -> None:
        print_json({**record, "exceeded": True, "extra_peak_mb": extra_mb})
        os._exit(EXIT_OVER)

    def timeout() -> None:
        print_json({**record, "timed_out": True})
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(args._timeout, timeout)
    timer.daemon = True
    timer.start()
    extra, seconds = measure_peak(fn, limit_mb=args._limit, on_exceed=abort)
    timer.cancel()
    print_json({**record, **info, "extra_peak_mb": extra, "seconds": seconds})


def fit(t1: int, y1: float, t2: int, y2: float):
    r"""(a, b) with y = a T + b T^2 through the two points (b clamped at 0: then y = a T through the larger)."""
    b = (y2 / t2 - y1 / t1) / (t2 - t1)
    if b < 0:
        return y2 / t2, 0.0
    return y1 / t1 - b * t1, b


def project(records: list, tokens: list, project_tokens: int, project_layers: int) -> list:
    rows = []
    by = {(r["method"], r["layers"], r["tokens"]): r for r in records if "extra_peak_mb" in r and not r.get("exceeded")}
    for m in METHODS:
        row = {"method": m}
        parts = {}
        for t in tokens:
            one, two = by.get((m, 1, t)), by.get((m, 2, t))
            if one is None or two is None:
                continue
            per = max(two["extra_peak_mb"] - one["extra_peak_mb"], 0.0)
            base = one["extra_peak_mb"] - per
            parts[t] = (base, per)
            row[f"peak_2_layers_{t}_gb"] = two["extra_peak_mb"] / 1024
            row[f"per_layer_{t}_gb"] = per / 1024
            row[f"seconds_2_layers_{t}"] = two.get("seconds")
        if len(parts) >= 2:
            (t1, (b1, p1)), (t2, (b2, p2)) = sorted(parts.items())[:2]
            base = sum(c * x for c, x in zip(fit(t1, b1, t2, b2), (project_tokens, project_tokens**2)))
            per = sum(c * x for c, x in zip(fit(t1, p1, t2, p2), (project_tokens, project_tokens**2)))
            upcast = layer_weight_gb(m == "decompx") * (2 if m == "decompx" else 1)
            peak = (base + project_layers * per) / 1024 + upcast
            row.update(base_projected_gb=base / 1024, per_layer_projected_gb=per / 1024, upcast_gb=upcast,
                       peak_projected_gb=peak, room_left_gb=GPU_GB - PARAMS_8B * 2 / 1e9 - peak)
        rows.append(row)
    return rows


def table(rows: list, tokens: list, project_tokens: int, project_layers: int) -> str:
    t_hi = max(tokens)
    head = (f"| method | peak, 2 layers, {t_hi} tok (GB) | per layer, {t_hi} tok (GB) | "
            f"projected peak, {project_layers} layers, {project_tokens} tok, + bf16 upcast (GB) | "
            f"room left on 80 GB next to 16 GB bf16 weights (GB) |\n|---|---|---|---|---|")
    out = [head]
    for r in rows:
        f = lambda k: "-" if r.get(k) is None else f"{r[k]:.2f}"  # noqa: E731
        out.append(f"| {r['method']} | {f(f'peak_2_layers_{t_hi}_gb')} | {f(f'per_layer_{t_hi}_gb')} | "
                   f"{f('peak_projected_gb')} | {f('room_left_gb')} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--layers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--project-tokens", type=int, default=4096)
    p.add_argument("--project-layers", type=int, default=32)
    p.add_argument("--limit-gb", type=float, default=12.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="save (and extend) the records here")
    p.add_argument("--table", default=None, help="print the projection table of a saved JSON file and exit")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_limit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--_timeout", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(args)
        return
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(table(saved["projection"], saved["tokens"], saved["project_tokens"], saved["project_layers"]))
        return
    saved = {"records": []}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            saved = json.load(f)
    records = saved["records"]
    for t in sorted(args.tokens):
        for m in args.methods:
            for n in args.layers:
                if any(r["method"] == m and r["layers"] == n and r["tokens"] == t for r in records):
                    continue
                t0 = time.perf_counter()
                argv = ["--_child", m, "--_layers", n, "--_tokens", t, "--_limit", args.limit_gb * 1024,
                        "--_timeout", args.timeout]
                try:
                    r = run_child(__file__, argv, ok_returncodes=(0, EXIT_OVER, EXIT_TIMEOUT))
                except RuntimeError as e:
                    r = {"method": m, "layers": n, "tokens": t, "failed": True, "error": str(e)[-800:]}
                r["child_wall_s"] = time.perf_counter() - t0
                records.append(r)
                print(json.dumps(r), flush=True)
                if args.json:
                    saved.update(records=records)
                    with open(args.json, "w") as f:
                        json.dump(saved, f, indent=1)
    tokens = sorted({r["tokens"] for r in records})
    rows = project(records, tokens, args.project_tokens, args.project_layers)
    saved.update(records=records, projection=rows, tokens=tokens, project_tokens=args.project_tokens,
                 project_layers=args.project_layers, config=LLAMA3_8B, threads=1, dtype="float32")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    print(table(rows, tokens, args.project_tokens, args.project_layers))


if __name__ == "__main__":
    main()
