r"""Information-flow routes on a real decoder (SmolLM2-135M-Instruct from a GGUF file): does the
graph's top head matter, and what does the whole graph cost on real weights?

Usage:
    nice python benchmarks/faithfulness/routes_smollm2.py --gguf-dir DIR [--gguf-file SmolLM2-135M-Instruct.Q4_1.gguf]
                                             [--threshold 0.04] [--long-tokens 512 (0: skip)] [--threads 2]

The model (30 layers, 9 heads of width 64, 3 key/value heads) is de-quantised to float32 by
transformers. For each short prompt: the predicted next token, the route graph at the last
position, its top head by either score of ``RouteGraph.top_heads`` (``importance``: the summed
importance of its kept edges; ``flow``: the final state's flow through them); then the logit of the
predicted token with that head's output zeroed (its slice of the o_proj input), against
zeroing each other head of the same layer: the top head's rank among the layer's heads by
|change of the logit|, its change, the mean change of the other heads, and whether it beats a
random other head of the layer (seeded). Then, on a ``--long-tokens`` input made of the prompts
repeated (so that induction heads have something to do), the whole graph against ALTI-Logit
of the predicted token, side by side (one warm-up call each, minimum of ``--repeats``).
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)

from _bench import print_json, time_interleaved  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "The Eiffel Tower is located in the city of",
    "One, two, three, four, five, six,",
    "Monday, Tuesday, Wednesday,",
    "The opposite of hot is",
    "Harry Potter was written by J. K.",
    "def add(a, b):\n    return a +",
    "Water freezes at zero degrees",
]


def zeroed_logit(model, ids, layer, head, target):
    at = model.model.layers[layer].self_attn
    dh = at.head_dim

    def pre(m, args):
        x = args[0].clone()
        x[..., head * dh:(head + 1) * dh] = 0
        return (x,)

    hook = at.o_proj.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, -1, target])
    finally:
        hook.remove()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf-dir", required=True, help="folder holding the GGUF file (and nothing to download)")
    p.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--threshold", type=float, default=0.04)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from captum_normattr import ALTILogitAttribution
    from captum_normattr.attr.routes import InformationFlowRoutes

    tok = AutoTokenizer.from_pretrained(args.gguf_dir, gguf_file=args.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(args.gguf_dir, gguf_file=args.gguf_file, dtype=torch.float32).eval()
    n_heads = model.config.num_attention_heads
    routes = InformationFlowRoutes(model)
    rng = random.Random(0)
    rows = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1]
        target = int(logits.argmax())
        base = float(logits[target])
        g = routes.attribute(ids, threshold=args.threshold)
        row = {"prompt": prompt, "prediction": tok.decode([target]), "logit": round(base, 3),
               "nodes": len(g.nodes), "edges": len(g.edges)}
        for by in ("importance", "flow"):
            (layer, head, total), = g.top_heads(1, by=by)
            change = [abs(zeroed_logit(model, ids, layer, h, target) - base) for h in range(n_heads)]
            others = [c for h, c in enumerate(change) if h != head]
            rand = rng.choice([h for h in range(n_heads) if h != head])
            row[by] = {"top_head": [layer, head], "score": round(total, 3), "top_change": round(change[head], 4),
                       "others_mean_change": round(sum(others) / len(others), 4),
                       "rank_in_layer": 1 + sum(c > change[head] for c in others),
                       "beats_random_head": change[head] > change[rand]}
        rows.append(row)
    summary = {by: {"beats_random_head": sum(r[by]["beats_random_head"] for r in rows),
                    "rank_1": sum(r[by]["rank_in_layer"] == 1 for r in rows)} for by in ("importance", "flow")}
    out = {"benchmark": "routes_smollm2", "threshold": args.threshold, "threads": args.threads, "prompts": len(rows),
           "summary": summary, "heads": rows}
    if args.long_tokens <= 0:
        out["load_average_1min"] = round(os.getloadavg()[0], 2)
        print_json(out)
        return out
    # the whole graph on a long input vs ALTI-Logit of the predicted token
    text = " ".join(PROMPTS * 200)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.long_tokens]
    with torch.no_grad():
        target = int(model(input_ids=ids).logits[0, -1].argmax())
    al = ALTILogitAttribution(model)
    graphs = {}

    def run_routes(x):
        graphs["g"] = routes.attribute(x, threshold=args.threshold)

    sec = time_interleaved({"alti_logit": lambda x: al.attribute(x, target=target), "routes": run_routes}, (ids,),
                           args.repeats, stat="min")
    g = graphs["g"]
    out.update({
        "long": {"tokens": int(ids.shape[1]), "seconds": {k: round(v, 2) for k, v in sec.items()},
                 "ratio": round(sec["routes"] / sec["alti_logit"], 3), "nodes": len(g.nodes), "edges": len(g.edges),
                 "head_edges": sum(e["kind"] == "head" for e in g.edges), "rows_per_layer": g.meta["rows_per_layer"]},
        "load_average_1min": round(os.getloadavg()[0], 2),
    })
    print_json(out)
    return out


if __name__ == "__main__":
    main()
