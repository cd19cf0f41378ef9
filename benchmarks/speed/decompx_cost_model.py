r"""DecompX's cost for n explained next-token logits at prompt length T: the adjoint against the
forward propagation, fitted as cost = a + b * n forward passes (issue 35, item 4).

Usage:
    nice python benchmarks/speed/decompx_cost_model.py [--lengths 32 128 512] [--targets 1 4 16 64]
        [--hidden 256] [--layers 4] [--threads 2] [--repeats 3] [--out results/decompx_cost_model.json]
        [--smollm2 DIR --smollm2-lengths 128]

Model: a random float32 ``LlamaForCausalLM`` (seed 0; ``--hidden`` wide, ``--layers`` layers, GQA 8/4
heads, FF 2.7x, vocabulary 2048: tiny but with the shapes of a real one), and optionally the
SmolLM2-135M checkpoint in ``--smollm2``. For every T and n, ``DecompXAttribution(model,
algorithm=...).explain_positions`` explains the last n positions of a random T-token sequence
(what ``DecompositionLLMAttribution`` and ``captum-normattr generate`` call), with
``algorithm="adjoint"`` and ``"forward"``; the unit is one plain forward pass of the model on the
same T tokens, timed interleaved with the two (the minimum of ``--repeats`` calls of each is kept;
the fit is on the seconds divided by the median forward pass over the n of that T). Per T, a and b of
each algorithm are fitted by least squares over n, and the crossover n* (the n above which the
forward propagation is cheaper) is reported; the two algorithms' scores are compared. The last
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
    r"""Least squares cost = a + b n."""
    x = torch.tensor([[1.0, float(n)] for n in ns], dtype=torch.float64)
    y = torch.tensor(costs, dtype=torch.float64)
    sol = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    return {"a": float(sol[0]), "b": float(sol[1])}


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
            scores = {alg: runs[alg]().scores for alg in ("adjoint", "forward")}  # also the warm-up
            plain()
            secs = {k: float("inf") for k in runs}
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
        ns = [r["n"] for r in rows]
        # fitted on the seconds, in units of the median forward pass (a single noisy unit would bend the line)
        unit = float(torch.tensor([r["forward_pass_seconds"] for r in rows]).median())
        fits = {alg: _fit(ns, [r["seconds"][alg] / unit for r in rows]) for alg in ("adjoint", "forward")}
        da, db = fits["forward"]["a"] - fits["adjoint"]["a"], fits["adjoint"]["b"] - fits["forward"]["b"]
        out[str(t)] = {"rows": rows, "forward_pass_seconds": unit, "fit_forwards": fits,
                       "crossover_n": (da / db) if db > 0 else None}
        print(f"T={t}: fit (forwards) {fits}, crossover n* = {out[str(t)]['crossover_n']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--targets", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smollm2", default=None, help="a local SmolLM2-135M folder (optional)")
    ap.add_argument("--smollm2-lengths", type=int, nargs="+", default=[128])
    ap.add_argument("--out", default=os.path.join(BENCHMARKS, "results", "decompx_cost_model.json"))
    args = ap.parse_args()
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
