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
model on a GPU casts one layer's weights to float32 while that layer is decomposed
(``LayerTensors`` holds W_O and the FF weights; DecompX adds W_V), twice for DecompX (its
adjoint reruns a layer while the next is released), and its bfloat16 recorded tensors live
next to their float32 casts for a moment: :func:`bf16_extra_gib` adds both analytically.
The projection is for the streaming engine on one GPU; "room left" = 79.6 GiB (an 80 GB
H100 as ``nvidia-smi`` reports it) - 14.96 GiB (the bfloat16 weights of Llama-3-8B, 8.03e9
parameters, 16.06 GB) - the projected peak - the bfloat16 casts. The CUDA context (about
0.5 GiB) and the caching allocator's slack are not included.

Usage (on a shared 2-core machine one child took 0.5-3 min at 1024-2048 tokens; the 2-layer
model is 1.75 GB of float32 weights and a 2048-token call adds up to 3 GB):

    nice -n 10 python benchmarks/memory/bigmodel_projection.py --tokens 1024 2048 --limit-gb 10 \
        --json benchmarks/results/bigmodel_projection.json
    nice -n 10 python benchmarks/memory/bigmodel_projection.py --tokens 4096 --layers 1 --limit-gb 10 \
        --json benchmarks/results/bigmodel_projection.json      # measured 1-layer figures at 4096
    python benchmarks/memory/bigmodel_projection.py --table benchmarks/results/bigmodel_projection.json

The file keeps every record; a rerun skips the (method, layers, tokens) already in it.

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _bench
from _bench import decoder_runner, llama_model, measure_peak, print_json, random_ids, rss_mb, run_child  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 vocab_size=1000, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
                 rope_theta=500000.0)
PARAMS_8B = 8.03e9
WEIGHTS_GIB = PARAMS_8B * 2 / 2**30  # Llama-3-8B in bfloat16: 16.06 GB = 14.96 GiB
GPU_GIB = 81559 / 1024  # an "80 GB" H100 as nvidia-smi reports it (81,559 MiB; an A100 80GB has 81,920)
TARGET = 42
EXIT_OVER, EXIT_TIMEOUT = 3, 4
METHODS = ("globenc", "alti", "alti_logit", "decompx")


def layer_weight_gb(decompx: bool) -> float:
    r"""float32 GiB of the weights one LayerTensors holds (W_O, W_up, W_gate, W_down; + W_V for DecompX)."""
    d, f, kv = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], LLAMA3_8B["num_key_value_heads"]
    dh = d // LLAMA3_8B["num_attention_heads"]
    n = d * d + 3 * d * f + (d * kv * dh if decompx else 0)
    return 4 * n / 2**30


def bf16_extra_gib(method: str, tokens: int) -> float:
    r"""What a bfloat16 model on a GPU adds to the float32 CPU figure, GiB (an analytic upper bound).

    One layer's weights cast to float32 while it is decomposed (twice for DecompX, whose adjoint
    reruns a layer while the next one's cast is alive), plus the bfloat16 recorded tensors alive
    next to their float32 casts while ``LayerTensors`` is built: the probabilities (H, T, T) and
    about ten (T, D) tensors. The forward pass of a bfloat16 model keeps half the bytes of the
    float32 one measured, which this bound does not subtract.
    """
    d, h = LLAMA3_8B["hidden_size"], LLAMA3_8B["num_attention_heads"]
    weights = layer_weight_gb(method == "decompx") * (2 if method == "decompx" else 1)
    recorded = 2 * (h * tokens * tokens + 10 * tokens * d) / 2**30
    return weights + recorded


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


def _at(coef, t: int) -> float:
    return coef[0] * t + coef[1] * t * t


def project(records: list, project_tokens: int, project_layers: int) -> list:
    r"""Per method: the measured figures, the fits, and the projection to ``project_layers`` layers (GiB).

    The fits use the two longest lengths measured with both 1 and 2 layers. At
    ``project_tokens`` a measured 1-layer figure, where there is one, replaces the fitted
    ``base + per_layer`` (the fit-only figure is kept as ``fit_only_1_layer_gib`` to show the
    extrapolation error); the further layers always come from the per-layer fit.
    """
    rows = []
    by = {(r["method"], r["layers"], r["tokens"]): r for r in records if "extra_peak_mb" in r and not r.get("exceeded")}
    P, L = project_tokens, project_layers
    for m in METHODS:
        row: dict = {"method": m}
        algos = sorted({r["algorithm"] for k, r in by.items() if k[0] == m and "algorithm" in r})
        if algos:
            row["algorithm"] = "/".join(algos)
        parts = {}
        for (mm, n, t), r in sorted(by.items()):
            if mm == m:
                row[f"extra_{n}_layer_{t}_gib"] = r["extra_peak_mb"] / 1024
                row[f"seconds_{n}_layer_{t}"] = r.get("seconds")
        for t in sorted({k[2] for k in by if k[0] == m}):
            one, two = by.get((m, 1, t)), by.get((m, 2, t))
            if one is None or two is None:
                continue
            per = max(two["extra_peak_mb"] - one["extra_peak_mb"], 0.0)
            parts[t] = (one["extra_peak_mb"] - per, per)
            row[f"per_layer_{t}_gib"] = per / 1024
            row[f"base_{t}_gib"] = (one["extra_peak_mb"] - per) / 1024
            row[f"peak_{L}_layers_{t}_gib"] = (one["extra_peak_mb"] + (L - 1) * per) / 1024
        if len(parts) >= 2:
            (t1, (b1, p1)), (t2, (b2, p2)) = sorted(parts.items())[-2:]
            base_c, per_c = fit(t1, b1, t2, b2), fit(t1, p1, t2, p2)
            row.update(fit_tokens=[t1, t2], base_fit_mib=dict(zip(("per_token", "per_token2"), base_c)),
                       per_layer_fit_mib=dict(zip(("per_token", "per_token2"), per_c)))
            per = _at(per_c, P)
            one_fit = _at(base_c, P) + per
            one = by.get((m, 1, P))
            one_mb = one["extra_peak_mb"] if one is not None else one_fit
            upcast = bf16_extra_gib(m, P)
            peak = (one_mb + (L - 1) * per) / 1024
            row.update(fit_only_1_layer_gib=one_fit / 1024, one_layer_source="measured" if one is not None else "fit",
                       one_layer_gib=one_mb / 1024, per_layer_projected_gib=per / 1024,
                       peak_projected_gib=peak, upcast_gib=upcast,
                       gpu_total_gib=WEIGHTS_GIB + peak + upcast, room_left_gib=GPU_GIB - WEIGHTS_GIB - peak - upcast)
        rows.append(row)
    return rows


def table(rows: list, project_tokens: int, project_layers: int) -> str:
    r"""The projection as a markdown table (GiB)."""
    P, L = project_tokens, project_layers
    head = ("| method | 1 / 2 layers, 1024 tok | 1 / 2 layers, 2048 tok | per layer, 1024 / 2048 tok "
            f"| {L} layers, 2048 tok | 1 layer, {P} tok | per layer, {P} tok (fit) | {L} layers, {P} tok "
            f"| + bf16 casts | GPU total with {WEIGHTS_GIB:.1f} GiB bf16 weights | room left of {GPU_GIB:.1f} GiB |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = [head]
    for r in rows:
        def f(k, d=2):
            return "-" if r.get(k) is None else f"{r[k]:.{d}f}"
        name = {"globenc": "GlobEnc", "alti": "ALTI", "alti_logit": "ALTI-Logit", "decompx": "DecompX"}[r["method"]]
        if r.get("algorithm"):
            name += f" ({r['algorithm']})"
        one = f("one_layer_gib") + ("" if r.get("one_layer_source") == "measured" else " (fit)")
        out.append(f"| {name} | {f('extra_1_layer_1024_gib')} / {f('extra_2_layer_1024_gib')} "
                   f"| {f('extra_1_layer_2048_gib')} / {f('extra_2_layer_2048_gib')} "
                   f"| {f('per_layer_1024_gib', 3)} / {f('per_layer_2048_gib', 3)} | {f(f'peak_{L}_layers_2048_gib')} "
                   f"| {one} | {f('per_layer_projected_gib', 3)} | {f('peak_projected_gib')} | {f('upcast_gib')} "
                   f"| {f('gpu_total_gib')} | **{f('room_left_gib', 1)}** |")
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
        print(table(saved["projection"], saved["project_tokens"], saved["project_layers"]))
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
    rows = project(records, args.project_tokens, args.project_layers)
    saved.update(records=records, projection=rows, project_tokens=args.project_tokens,
                 project_layers=args.project_layers, config=LLAMA3_8B, threads=1, dtype="float32",
                 weights_gib=WEIGHTS_GIB, gpu_gib=GPU_GIB)
    saved.pop("tokens", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    print(table(rows, args.project_tokens, args.project_layers))


if __name__ == "__main__":
    main()
