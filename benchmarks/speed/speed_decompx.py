r"""Speed and memory of DecompX against one plain forward pass, on MiniLM with a classification head.

Usage:
    python benchmarks/speed/speed_decompx.py [--batch 16] [--tokens 64 128] [--repeats 3] [--modes separate separate-forward spread]
    python benchmarks/speed/speed_decompx.py --model llama --batch 1 --tokens 64 128   # decoder rows

``--model llama``: the ~100M-parameter Llama-family config of ``speed_decoder.py`` (random
weights; GQA 12/4 heads, SwiGLU FF integrated with 48 Gauss-Legendre nodes), bare
``LlamaModel`` with its (tied) embedding matrix as unembedding; DecompX explains the
next-token logit of one token at the last position.

The model is the packaged pretrained all-MiniLM-L6-v2 (a 6-layer BERT) under a randomly
initialised 2-class head (``BertForSequenceClassification``; the head does not change the
cost). Prints the minimum times (2 torch threads by default) of the forward pass of the classifier and of DecompX
(interleaved repeats, so that noise hits all alike; the slow forward-algorithm runs only
``--slow-repeats`` times), the ratio in forward passes, and the
peak extra memory of one call: resident-set growth over the loaded model, polled every
2 ms, in a fresh subprocess per (method, length).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))  # this checkout's package, not an installed one
sys.path.insert(0, str(BENCHMARKS))

from _bench import measure_peak, print_json, random_ids, run_child, time_interleaved  # noqa: E402


def _setup(batch: int, tokens: int, model_name: str = "minilm"):
    if model_name == "llama":
        from speed_decoder import _model

        ids = random_ids(batch, tokens, low=3, high=32000, cls=None)
        return _model(), ids, torch.ones_like(ids)
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from captum_normattr import default_model_path

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(default_model_path(), num_labels=2).eval()
    ids = random_ids(batch, tokens, sep=102)
    return model, ids, torch.ones_like(ids)


def _runner(name: str, model):
    from captum_normattr import DecompXAttribution

    decoder = model.config.model_type == "llama"
    if name == "forward":
        if decoder:
            return lambda ids, mask: model(input_ids=ids, attention_mask=mask, use_cache=False)
        return lambda ids, mask: model(input_ids=ids, attention_mask=mask)
    if name.startswith("decompx-"):
        mode, _, algorithm = name.split("-", 1)[1].partition("-")
        if decoder:
            a = DecompXAttribution(model, bias_mode=mode, algorithm=algorithm or "auto", unembedding=model.embed_tokens.weight)
            return lambda ids, mask: a.attribute(ids, target=42, additional_forward_args=(mask,))
        a = DecompXAttribution(model, bias_mode=mode, algorithm=algorithm or "auto")
        return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))
    raise ValueError(name)


def _slow(name: str) -> bool:
    # the T-parts forward algorithm; not the plain forward pass, which is warmed up and repeated like the adjoint
    return name.startswith("decompx-") and (name.endswith("-forward") or name == "decompx-spread")


def time_methods(batch: int, tokens: int, repeats: int, modes, slow_repeats: int = 1, model_name: str = "minilm") -> dict:
    model, ids, mask = _setup(batch, tokens, model_name)
    names = ["forward"] + [f"decompx-{m}" for m in modes]
    runs = {n: _runner(n, model) for n in names}
    slow = [n for n in names if _slow(n)]  # long enough not to need a warm-up, repeated only slow_repeats times
    med = time_interleaved(runs, (ids, mask), repeats, max_repeats={n: slow_repeats for n in slow}, no_warm_up=slow,
                           stat="min")
    return {"batch": batch, "tokens": tokens, "seconds": med,
            "ratio": {n: med[n] / med["forward"] for n in names if n != "forward"}}


def peak_memory_child(name: str, batch: int, tokens: int, model_name: str = "minilm") -> None:
    model, ids, mask = _setup(batch, tokens, model_name)
    extra_mb, seconds = measure_peak(_runner(name, model), ids, mask)
    print_json({"method": name, "extra_peak_mb": extra_mb, "seconds": seconds})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["separate", "separate-forward", "spread"],
                   help="separate (adjoint algorithm), separate-forward (forward algorithm), spread (forward)")
    p.add_argument("--slow-repeats", type=int, default=1, help="repeats of the forward-algorithm runs")
    p.add_argument("--model", choices=["minilm", "llama"], default="minilm",
                   help="minilm (+ 2-class head) or llama (the ~100M decoder config of speed_decoder.py)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--_memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child:
        peak_memory_child(args._memory_child, args.batch, args.tokens[0], args.model)
        return
    torch.set_num_threads(args.threads)
    what = "MiniLM + 2-class head" if args.model == "minilm" else "Llama-family ~100M (random weights), next-token logit"
    print(f"{what}, batch {args.batch}, min of {args.repeats} (torch threads {torch.get_num_threads()})")
    for tokens in args.tokens:
        res = time_methods(args.batch, tokens, args.repeats, args.modes, args.slow_repeats, args.model)
        s = res["seconds"]
        print(f"{tokens} tokens: forward {s['forward']:.3f} s")
        for m in args.modes:
            n = f"decompx-{m}"
            print(f"  DecompX ({m:<16}) {s[n]:.3f} s = {res['ratio'][n]:.1f} forward passes (goal: decoders <= 4)")
        for name in ["forward"] + [f"decompx-{m}" for m in args.modes]:
            r = run_child(__file__, ["--_memory_child", name, "--batch", str(args.batch), "--tokens", str(tokens),
                                     "--model", args.model])
            print(f"  peak extra memory {name:<18} {r['extra_peak_mb']:.0f} MB")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
