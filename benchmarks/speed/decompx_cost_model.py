r"""DecompX's cost for n explained next-token logits at prompt length T: the adjoint against the
forward propagation, fitted as cost = a + b * n forward passes (issue 35, item 4).

Usage:
    python benchmarks/speed/decompx_cost_model.py [--lengths 32 128 512]
        [--targets 1 16 64 256] [--hidden 256] [--layers 4] [--threads 1] [--repeats 2] [--out results/decompx_cost_model.json]
        [--smollm2 DIR --smollm2-lengths 128]
    python benchmarks/speed/decompx_cost_model.py --merge A.json B.json --out results/decompx_cost_model.json

Model: a random float32 ``LlamaForCausalLM`` (seed 0; ``--hidden`` wide, ``--layers`` layers, GQA 8/4
heads, FF 2.7x, vocabulary 2048: tiny but with the shapes of a real one), and optionally the
SmolLM2-135M checkpoint in ``--smollm2``. For every T and n, ``DecompXAttribution(model,
algorithm=...).explain_positions`` explains the last n positions of a random T-token sequence
(what ``DecompositionLLMAttribution`` and ``captum-normattr generate`` call), with
``algorithm="adjoint"`` and ``"forward"``; the unit is one plain forward pass of the model on the
same T tokens, timed interleaved with the two (the minimum of the warm-up call and ``--repeats`` calls of
each is kept;
the fit is on the seconds divided by the median forward pass over the n of that T). Per T, a and b of
each algorithm are fitted by least squares over n, and the crossover n* (the n above which the
forward propagation is cheaper) is reported (a, b >= 0: a noisy point can give a negative fit); the two algorithms' scores are compared. The last
line of the output is the JSON of all numbers (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)


def _timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _fit(ns: List[int], costs: List[float]) -> Dict[str, float]:
    r"""Least squares cost = a + b n with a, b >= 0 (a cost is never negative; a noisy point can make one so)."""
    x = torch.tensor([[1.0, float(n)] for n in ns], dtype=torch.float64)
    y = torch.tensor(costs, dtype=torch.float64)
    a, b = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
    if a < 0:  # through the origin
        a, b = 0.0, float((x[:, 1] * y).sum() / (x[:, 1] ** 2).sum())
    if b < 0:  # constant
        a, b = float(y.mean()), 0.0
    return {"a": max(a, 0.0), "b": max(b, 0.0)}


def measure(model, vocab: int, lengths: List[int], targets: List[int], repeats: int) -> Dict[str, object]:
    from captum_normattr import DecompXAttribution

    out: Dict[str, object] = {}
    g = torch.Generator().manual_seed(1)
    for t in lengths:
        ids = torch.randint(3, vocab, (t,), generator=g)

        def plain():
            with torch.no_grad():
                model(input_ids=ids[None], use_cache=False)

        rows = []
        for n in [n for n in targets if n < t]:
            positions = torch.arange(t - n, t)
            target = torch.randint(3, vocab, (n,), generator=g)
            runs = {"plain": plain}
            for alg in ("adjoint", "forward"):
                attr = DecompXAttribution(model, algorithm=alg)
                runs[alg] = (lambda a: lambda: a.explain_positions(ids, positions, target))(attr)
            secs = {k: float("inf") for k in runs}
            scores = {}
            for alg in ("adjoint", "forward"):  # the warm-up call, timed too (the minimum is kept)
                t0 = time.perf_counter()
                scores[alg] = runs[alg]().scores
                secs[alg] = time.perf_counter() - t0
            plain()
            for _ in range(repeats):  # interleaved: the three see the same load
                for k, fn in runs.items():
                    secs[k] = min(secs[k], _timed(fn, 1))
            unit = secs.pop("plain")
            diff = float((scores["adjoint"] - scores["forward"]).abs().max() / scores["forward"].abs().max())
            rows.append({"n": n, "seconds": secs, "forward_pass_seconds": unit,
                         "forwards": {k: v / unit for k, v in secs.items()}, "scores_max_rel_diff": diff})
            print(f"T={t} n={n}: forward pass {unit:.4f}s; adjoint {secs['adjoint']:.3f}s "
                  f"({secs['adjoint'] / unit:.1f} fw), forward {secs['forward']:.3f}s ({secs['forward'] / unit:.1f} fw), "
                  f"diff {diff:.1e}", flush=True)
        # fitted on the seconds, in units of the median forward pass (a single noisy unit would bend the line)
        out[str(t)] = summarize(rows)
        print(f"T={t}: fit (forwards) {out[str(t)]['fit_forwards']}, crossover n* = {out[str(t)]['crossover_n']}",
              flush=True)
    return out


def summarize(rows: List[Dict[str, object]]) -> Dict[str, object]:
    r"""Fit a + b n per algorithm (in units of the median forward pass over ``rows``) and the crossover n*."""
    ns = [r["n"] for r in rows]
    unit = float(torch.tensor([r["forward_pass_seconds"] for r in rows]).median())
    fits = {alg: _fit(ns, [r["seconds"][alg] / unit for r in rows]) for alg in ("adjoint", "forward")}
    da, db = fits["forward"]["a"] - fits["adjoint"]["a"], fits["adjoint"]["b"] - fits["forward"]["b"]
    return {"rows": rows, "forward_pass_seconds": unit, "fit_forwards": fits, "crossover_n": (da / db) if db > 0 else None}


def merge(paths: List[str], key: str = "tiny_llama") -> Dict[str, object]:
    r"""Pool the rows of several result files (per T and n: the run with the smaller sum of seconds, the least
    loaded), and refit."""
    pooled: Dict[str, Dict[int, Dict[str, object]]] = {}
    for path in paths:
        with open(path) as f:
            for t, v in json.load(f)[key].items():
                for r in v["rows"]:
                    old = pooled.setdefault(t, {}).get(r["n"])
                    if old is None or sum(r["seconds"].values()) < sum(old["seconds"].values()):
                        pooled[t][r["n"]] = r
    return {t: summarize([rows[n] for n in sorted(rows)]) for t, rows in sorted(pooled.items(), key=lambda kv: int(kv[0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--targets", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smollm2", default=None, help="a local SmolLM2-135M folder (optional)")
    ap.add_argument("--smollm2-lengths", type=int, nargs="+", default=[128])
    ap.add_argument("--out", default=os.path.join(BENCHMARKS, "results", "decompx_cost_model.json"))
    ap.add_argument("--merge", nargs="+", default=None,
                    help="result files to pool (per T and n the least loaded run) and refit into --out; runs nothing")
    args = ap.parse_args()
    if args.merge:
        with open(args.merge[0]) as f:
            result = json.load(f)
        result["tiny_llama"] = merge(args.merge)
        result["merged_from"] = [os.path.basename(p) for p in args.merge]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({t: {"fit_forwards": v["fit_forwards"], "crossover_n": v["crossover_n"]}
                          for t, v in result["tiny_llama"].items()}))
        return
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=int(2.6875 * args.hidden), vocab_size=2048, max_position_embeddings=4096,
                  hidden_act="silu")
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    result: Dict[str, object] = {
        "config": dict(config, dtype="float32", threads=args.threads, repeats=args.repeats, torch=torch.__version__),
        "tiny_llama": measure(model, config["vocab_size"], args.lengths, args.targets, args.repeats),
    }
    if args.smollm2:
        from transformers import AutoModelForCausalLM

        big = AutoModelForCausalLM.from_pretrained(args.smollm2, dtype=torch.float32).eval()
        result["smollm2"] = measure(big, int(big.config.vocab_size), args.smollm2_lengths, args.targets, args.repeats)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
